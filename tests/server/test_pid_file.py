"""`serve --pid-file` and deploy/systemd/kvsplice.service: the file is written once the sidecar
listens and removed on a clean exit; a path it cannot use or a running process's pid is one
line. The unit's ExecStart, ExecReload (SIGHUP to the pid in the file) and stop signal run as
written against a real `kvsplice serve` process."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from helpers.store import make_meta, make_payload
from test_serve_refusals import refusal

from kvsplice.common.errors import ServeRefused, Unauthenticated
from kvsplice.server.pid_file import check_pid_file, remove_pid_file, write_pid_file
from kvsplice.server.tenants import Tenant, TenantTable, token_sha256
from kvsplice.storeclient.client import StoreClient

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "kvsplice.service"
STARTUP = re.compile(r"kvsplice serving: grpc (\S+), admin\+dashboard (\S+);")
TOKENS = {"team-a": "team-a-token-0123456789", "team-b": "team-b-token-0123456789"}


@pytest.fixture
def running_pid() -> Iterator[int]:
    """The pid of a process that runs for the test's duration (not this one)."""
    process = subprocess.Popen(["sleep", "120"])
    try:
        yield process.pid
    finally:
        process.kill()
        process.wait()


def exited_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_pid_file_is_refused_when_it_names_a_running_process_or_cannot_be_written(
    tmp_path: Path, running_pid: int
) -> None:
    live = tmp_path / "live.pid"
    live.write_text(f"{running_pid}\n")
    with pytest.raises(ServeRefused, match=f"holds pid {running_pid}, a running process"):
        check_pid_file(live)
    with pytest.raises(ServeRefused, match="does not exist"):
        check_pid_file(tmp_path / "missing" / "k.pid")
    with pytest.raises(ServeRefused, match="is a directory"):
        check_pid_file(tmp_path)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ServeRefused, match="not writable"):
            check_pid_file(locked / "k.pid")


@pytest.mark.parametrize("content", ["stale", "garbage", "own pid", "empty"])
def test_a_stale_or_unreadable_pid_file_is_reused(tmp_path: Path, content: str) -> None:
    path = tmp_path / "k.pid"
    text = {"stale": str(exited_pid()), "garbage": "not a pid", "own pid": str(os.getpid())}
    path.write_text(text.get(content, ""))
    check_pid_file(path)
    write_pid_file(path)
    assert path.read_text() == f"{os.getpid()}\n"
    assert [p.name for p in tmp_path.iterdir()] == ["k.pid"]  # no partial file left
    remove_pid_file(path)
    assert not path.exists()


def test_a_pid_file_a_successor_rewrote_is_left_alone(tmp_path: Path, running_pid: int) -> None:
    path = tmp_path / "k.pid"
    path.write_text(f"{running_pid}\n")
    remove_pid_file(path)
    assert path.read_text() == f"{running_pid}\n"


def test_serve_refuses_the_pid_file_of_a_running_sidecar_in_one_line(
    tmp_path: Path, running_pid: int, capsys: pytest.CaptureFixture[str]
) -> None:
    pid_file = tmp_path / "kvsplice.pid"
    pid_file.write_text(f"{running_pid}\n")
    lmdb = tmp_path / "data" / "lmdb"
    argv = ["--listen", "127.0.0.1:0", "--admin-listen", "off", "--lmdb-path", str(lmdb)]
    code, line = refusal([*argv, "--pid-file", str(pid_file)], capsys)
    assert code == 1
    assert line.startswith(f"kvsplice serve: error: pid file {pid_file} holds pid {running_pid}")
    assert not (tmp_path / "data").exists()


# -- the systemd unit, run as written ----------------------------------------------------


def unit_values(key: str) -> list[str]:
    prefix = f"{key}="
    return [line.removeprefix(prefix) for line in UNIT.read_text().splitlines() if line.startswith(prefix)]  # fmt: skip


def write_tenants(path: Path, *names: str) -> None:
    tenants = (Tenant(n, token_sha256(TOKENS[n]), (f"{n}*",), "writer") for n in names)
    path.write_text(TenantTable(tuple(tenants)).dumps())


def unit_command(tmp_path: Path) -> list[str]:
    """ExecStart with the unit's directories under `tmp_path` and free ports (port 0)."""
    (exec_start,) = unit_values("ExecStart")
    console_script = Path(sys.executable).parent / "kvsplice"  # as `pip install` puts it
    for directory in ("/var/lib/kvsplice", "/etc/kvsplice", "/run/kvsplice"):
        exec_start = exec_start.replace(directory, str(tmp_path / directory.rsplit("/", 2)[-2]))
    exec_start = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:0", exec_start)
    binary, *argv = shlex.split(exec_start)
    assert binary.endswith("/bin/kvsplice"), binary
    return [sys.executable, str(console_script), *argv]


def unit_environment() -> dict[str, str]:
    pairs = (value.split("=", 1) for value in unit_values("Environment"))
    return {**os.environ, **dict(pairs)}


def wait_until(probe: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def accepted(target: str, tenant: str) -> bool:
    payload = make_payload(512)
    meta = make_meta([7], payload, namespace=f"{tenant}.salt-0123456789abcdef")
    with StoreClient(target, meta.namespace, token=TOKENS[tenant]) as client:
        try:
            return client.put_segment(meta, payload)
        except Unauthenticated:
            return False


def test_the_units_start_reload_and_stop_drive_a_real_sidecar(tmp_path: Path) -> None:
    for directory in ("lib", "etc", "run"):
        (tmp_path / directory).mkdir()
    write_tenants(tmp_path / "etc" / "tenants.json", "team-a")
    pid_file = tmp_path / "run" / "kvsplice.pid"
    log = tmp_path / "sidecar.log"
    with log.open("wb") as stderr:
        sidecar = subprocess.Popen(unit_command(tmp_path), env=unit_environment(), stderr=stderr)
    try:
        wait_until(pid_file.exists, "the pid file is written once the sidecar listens")
        assert int(pid_file.read_text()) == sidecar.pid  # Type=exec: the main process
        found = STARTUP.search(log.read_text())
        assert found is not None, log.read_text()
        target, admin_url = found.groups()
        assert admin_url.startswith("http://127.0.0.1:") and not admin_url.endswith(":0")
        assert httpx.get(f"{admin_url}/healthz", timeout=5).status_code == 200
        assert accepted(target, "team-a") and not accepted(target, "team-b")

        write_tenants(tmp_path / "etc" / "tenants.json", "team-a", "team-b")
        (reload,) = unit_values("ExecReload")
        reload = reload.replace("$MAINPID", pid_file.read_text().strip())
        subprocess.run(shlex.split(reload), check=True, timeout=10)
        wait_until(lambda: accepted(target, "team-b"), "the new tenant is accepted", 10.0)
        assert sidecar.poll() is None  # reloaded, not killed

        (kill_signal,) = unit_values("KillSignal")
        (stop_timeout_s,) = unit_values("TimeoutStopSec")
        sidecar.send_signal(getattr(signal, kill_signal))
        assert sidecar.wait(float(stop_timeout_s)) == 0
        assert not pid_file.exists()  # removed on a clean exit
    finally:
        if sidecar.poll() is None:
            sidecar.kill()
            sidecar.wait()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_systemd_finds_nothing_to_warn_about_in_the_unit(tmp_path: Path) -> None:
    unit = tmp_path / "kvsplice.service"  # its ExecStart binary must exist to verify
    text = UNIT.read_text().replace("/opt/kvsplice/.venv/bin/kvsplice", shutil.which("true") or "")
    unit.write_text(text)
    checked = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert (checked.returncode, checked.stderr.strip()) == (0, "")
