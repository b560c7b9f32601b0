"""`kvsplice serve` in a child process on ports the kernel picks, found from its startup line.

NOTE: no port is chosen by binding a probe socket and closing it: another test or process
may take that port before the child binds it (a failed start, or a client of another test
reaching this sidecar). Port 0 and the startup line leave no window. The pid file, written
once the sidecar listens, says when it is ready.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KVSPLICE = [sys.executable, "-c", "from kvsplice.cli import main; main()"]
STARTUP = re.compile(r"kvsplice serving: grpc (\S+), (?:admin\+dashboard (\S+)|admin off);")


@dataclass
class ServeProcess:
    """A started `kvsplice serve`: its gRPC `target`, `admin_url` (None: off) and files."""

    process: subprocess.Popen[bytes]
    log_path: Path
    pid_file: Path
    target: str
    admin_url: str | None

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then its exit status (killed past `timeout_s`)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def start_serve(
    workdir: Path, *argv: str, admin: bool = True, env: dict[str, str] | None = None,
    timeout_s: float = 60.0,
) -> ServeProcess:  # fmt: skip
    """`kvsplice serve --listen 127.0.0.1:0 [--admin-listen 127.0.0.1:0] --pid-file ... ARGV`
    with its log in `workdir/serve.log`; returns once it listens. RuntimeError (with the log)
    if it exits or stays silent past `timeout_s`."""
    workdir.mkdir(parents=True, exist_ok=True)
    pid_file, log_path = workdir / "kvsplice.pid", workdir / "serve.log"
    command = [*KVSPLICE, "serve", "--listen", "127.0.0.1:0", "--pid-file", str(pid_file)]
    command += ["--admin-listen", "127.0.0.1:0" if admin else "off", *argv]
    environment = {**os.environ, "KVSPLICE_LOG_LEVEL": "info", **(env or {})}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=log, env=environment)
    deadline = time.monotonic() + timeout_s
    while _pid_in(pid_file) != process.pid:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise RuntimeError(f"kvsplice serve did not start:\n{log_path.read_text()}")
        time.sleep(0.05)
    found = STARTUP.search(log_path.read_text())
    if found is None:
        process.kill()
        raise RuntimeError(f"no startup line in the log:\n{log_path.read_text()}")
    return ServeProcess(process, log_path, pid_file, found.group(1), found.group(2))


def _pid_in(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None
