"""Running untrusted generated Python in a child process with a timeout and resource limits.

Owns `ExecLimits`, `ExecResult` and `run_program`. It never `exec`s code in this
process: the program is written to a temp dir and run by a fresh interpreter in
its own session, whose first act is to set CPU-time, memory, file-size and
open-file limits. It is a guard against accidents, not a security boundary.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MIB = 1 << 20
STDERR_TAIL_CHARS = 2000
# NOTE: the limits are set by the child interpreter before it runs the program,
# not in a `preexec_fn`: this process runs gRPC and torch threads, and Python
# documents `preexec_fn` as unsafe (it may deadlock) in a threaded parent.
_BOOTSTRAP = """\
import resource, runpy, sys
script, *limits = sys.argv[1:]
for limit in limits:
    name, value = limit.split("=")
    resource.setrlimit(getattr(resource, name), (int(value), int(value)))
sys.argv = [script]
runpy.run_path(script, run_name="__main__")
"""


@dataclass(frozen=True)
class ExecLimits:
    """Wall-clock timeout, CPU seconds, address-space bytes and file-size bytes of a run."""

    timeout_s: float = 5.0
    cpu_s: int = 10
    memory_bytes: int = 1024 * MIB
    file_bytes: int = 16 * MIB
    max_open_files: int = 64

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_bytes", "file_bytes", "max_open_files"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ExecResult:
    """`passed`: exited 0 within the limits. `timed_out`: killed at `timeout_s`."""

    passed: bool
    timed_out: bool
    returncode: int | None
    stderr_tail: str


def run_program(source: str, limits: ExecLimits | None = None) -> ExecResult:
    """Run `source` as a script in a child interpreter; a timeout counts as a failure."""
    limits = limits or ExecLimits()
    with tempfile.TemporaryDirectory(prefix="kvsplice-exec-") as workdir:
        script = Path(workdir) / "program.py"
        script.write_text(source, encoding="utf-8")
        process = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, str(script), *_limit_args(limits)],
            cwd=workdir,
            env={"PATH": os.defpath, "PYTHONHASHSEED": "0"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group, so a timeout kills any children
        )
        return _wait(process, limits.timeout_s)


def _wait(process: subprocess.Popen[bytes], timeout_s: float) -> ExecResult:
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        _, stderr = process.communicate()
        return ExecResult(False, True, process.returncode, _tail(stderr))
    return ExecResult(process.returncode == 0, False, process.returncode, _tail(stderr))


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    # It may exit between the timeout and the kill: then there is nothing left to stop.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def _limit_args(limits: ExecLimits) -> list[str]:
    """`RLIMIT_<NAME>=<value>` arguments for the bootstrap (and no core dumps)."""
    return [
        f"RLIMIT_CPU={limits.cpu_s}",
        f"RLIMIT_AS={limits.memory_bytes}",
        f"RLIMIT_FSIZE={limits.file_bytes}",
        f"RLIMIT_NOFILE={limits.max_open_files}",
        "RLIMIT_CORE=0",
    ]


def _tail(stderr: bytes | None) -> str:
    return (stderr or b"").decode("utf-8", errors="replace")[-STDERR_TAIL_CHARS:]
