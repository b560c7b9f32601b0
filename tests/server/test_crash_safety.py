"""Crash safety of `kvsplice serve` in a real process: SIGKILL in the middle of a put load
loses no acknowledged put and serves no corrupt segment after restart (streamed puts, and
staged puts at the default durability: the fsync window bounds what an OS crash loses, and
a crash of the process alone loses nothing committed); a second sidecar on the same port
or LMDB directory exits with one clear line."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from helpers.serve_process import KVSPLICE, ServeProcess, start_serve
from helpers.store import NAMESPACE, make_meta, make_payload

from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc
from kvsplice.storage.config import LMDBTierConfig, describe_durability
from kvsplice.storage.payload_files import PAYLOAD_DIR
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig
from kvsplice.storeclient.wire import put_requests

STAGED_NBYTES = 1 << 20  # staged (>= MIN_STAGED_NBYTES)


def serve(lmdb_dir: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    """A sidecar that is expected to refuse to start (its stderr piped)."""
    command = [*KVSPLICE, "serve", "--listen", f"127.0.0.1:{port}", "--admin-listen", "off"]
    return subprocess.Popen(
        [*command, "--lmdb-path", str(lmdb_dir), "--memory-mib", "0", *extra],
        stderr=subprocess.PIPE,
        env={**os.environ, "KVSPLICE_LOG_LEVEL": "WARNING"},
    )


def start(workdir: Path, lmdb_dir: Path) -> ServeProcess:
    return start_serve(workdir, "--lmdb-path", str(lmdb_dir), "--memory-mib", "0", admin=False)


def put_until_stopped(target: str, acked: list[int], stop: threading.Event) -> None:
    with grpc.insecure_channel(target) as channel:
        stub = store_pb2_grpc.SegmentStoreStub(channel)
        i = 0
        while not stop.is_set():
            payload = make_payload(200_000, seed=i)
            try:
                stub.PutSegment(
                    put_requests(make_meta([i + 1], payload), payload, 65536), timeout=5
                )
            except grpc.RpcError:
                return  # the server died: this put was never acknowledged
            acked.append(i)
            i += 1


def kill_mid_load(
    sidecar: ServeProcess,
    put_until: Callable[[str, list[int], threading.Event], None],
    load_s: float,
) -> list[int]:
    """SIGKILL `sidecar` `load_s` into a put load by `put_until`; the puts it acknowledged."""
    acked: list[int] = []
    try:
        stop = threading.Event()
        writer = threading.Thread(target=put_until, args=(sidecar.target, acked, stop))
        writer.start()
        time.sleep(load_s)
        sidecar.process.send_signal(signal.SIGKILL)
        sidecar.process.wait(10)
        stop.set()
        writer.join(30)
    finally:
        sidecar.process.kill()
    assert len(acked) > 5
    return acked


@pytest.mark.slow
def test_sigkill_mid_load_loses_no_acknowledged_put(tmp_path: Path) -> None:
    sidecar = start(tmp_path / "sidecar", tmp_path / "lmdb")
    acked = kill_mid_load(sidecar, put_until_stopped, load_s=2.0)
    assert sidecar.pid_file.exists()  # a crash leaves it: the restart reuses it (stale)
    sidecar = start(tmp_path / "sidecar", tmp_path / "lmdb")
    try:
        with grpc.insecure_channel(sidecar.target) as channel:
            stub = store_pb2_grpc.SegmentStoreStub(channel)
            for i in acked:
                payload = make_payload(200_000, seed=i)
                meta = make_meta([i + 1], payload)
                request = pb.GetSegmentRequest(
                    namespace=meta.namespace, context_key=meta.context_key
                )
                replies = list(stub.GetSegment(request, timeout=10))
                assert b"".join(r.chunk for r in replies[1:]) == payload, i
    finally:
        sidecar.stop()


def put_staged_until_stopped(target: str, acked: list[int], stop: threading.Event) -> None:
    config = StoreClientConfig(put_timeout_s=5.0)
    with StoreClient(target, NAMESPACE, config=config) as client:
        i = 0
        while not stop.is_set():
            payload = make_payload(STAGED_NBYTES, seed=i)
            if not client.put_segment(make_meta([i + 1], payload), payload):
                return  # the server died: this put was never acknowledged
            acked.append(i)
            i += 1
        assert client.counters.num_staged_puts == len(acked)


@pytest.mark.slow
def test_sigkill_at_the_default_durability_loses_no_acknowledged_staged_put(
    tmp_path: Path,
) -> None:
    """The probe of issue 51: `serve` as shipped (only its directory named), staged puts
    through the fsync window, SIGKILL. What the window allows a process crash to lose is 0
    (committed pages live in the kernel's page cache); an OS crash could lose the window."""
    lmdb_dir = tmp_path / "lmdb"
    sidecar = start_serve(tmp_path / "sidecar", "--lmdb-path", str(lmdb_dir), admin=False)
    default = describe_durability(LMDBTierConfig(str(lmdb_dir)))
    assert "fsync every" in default and default in sidecar.log()  # ran at the default
    acked = kill_mid_load(sidecar, put_staged_until_stopped, load_s=3.0)
    sidecar = start_serve(tmp_path / "sidecar", "--lmdb-path", str(lmdb_dir), admin=False)
    try:
        config = StoreClientConfig(same_host_reads=False)
        with StoreClient(sidecar.target, NAMESPACE, config=config) as client:
            lost = [i for i in acked if not _holds(client, i)]
    finally:
        sidecar.stop()
    assert lost == []  # allowed for a process crash: none
    assert any((lmdb_dir / PAYLOAD_DIR).iterdir())  # the payloads were adopted as files


def _holds(client: StoreClient, i: int) -> bool:
    payload = make_payload(STAGED_NBYTES, seed=i)
    found = client.get_segment(make_meta([i + 1], payload).context_key)
    return found is not None and bytes(found[1]) == payload


@pytest.mark.slow
def test_a_second_sidecar_on_the_same_port_or_directory_exits_with_one_line(
    tmp_path: Path,
) -> None:
    first = start(tmp_path / "first", tmp_path / "a")  # its port is busy, its LMDB locked
    port = int(first.target.rsplit(":", 1)[1])
    try:
        for lmdb_dir, listen_port, reason in (
            (tmp_path / "b", port, "address already in use"),
            (tmp_path / "a", 0, "is in use by another kvsplice process"),
        ):
            second = serve(lmdb_dir, listen_port)
            _, stderr = second.communicate(timeout=60)
            lines = stderr.decode().strip().splitlines()
            assert second.returncode == 1
            assert len(lines) == 1 and reason in lines[0], lines
    finally:
        first.stop()
