"""Crash safety of `kvsplice serve` in a real process: SIGKILL in the middle of a put load
loses no acknowledged put and serves no corrupt segment after restart; a second sidecar
on the same port or LMDB directory exits with one clear line."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from helpers.store import make_meta, make_payload
from test_serve_sigterm import wait_serving

from kvsplice.client.store.store_wire import put_requests
from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc

KVSPLICE = [sys.executable, "-c", "from kvsplice.cli import main; main()"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def serve(lmdb_dir: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    command = [*KVSPLICE, "serve", "--listen", f"127.0.0.1:{port}", "--admin-listen", "off"]
    return subprocess.Popen(
        [*command, "--lmdb-path", str(lmdb_dir), "--memory-mib", "0", *extra],
        stderr=subprocess.PIPE,
        env={**os.environ, "KVSPLICE_LOG_LEVEL": "WARNING"},
    )


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


@pytest.mark.slow
def test_sigkill_mid_load_loses_no_acknowledged_put(tmp_path: Path) -> None:
    port = free_port()
    target = f"127.0.0.1:{port}"
    process = serve(tmp_path / "lmdb", port)
    acked: list[int] = []
    try:
        wait_serving(target)
        stop = threading.Event()
        writer = threading.Thread(target=put_until_stopped, args=(target, acked, stop))
        writer.start()
        time.sleep(2.0)
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        stop.set()
        writer.join(10)
    finally:
        process.kill()
    assert len(acked) > 5
    process = serve(tmp_path / "lmdb", port)
    try:
        wait_serving(target)
        with grpc.insecure_channel(target) as channel:
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
        process.send_signal(signal.SIGTERM)
        process.wait(30)


@pytest.mark.slow
def test_a_second_sidecar_on_the_same_port_or_directory_exits_with_one_line(
    tmp_path: Path,
) -> None:
    port = free_port()
    first = serve(tmp_path / "a", port)
    try:
        wait_serving(f"127.0.0.1:{port}")
        for lmdb_dir, listen_port, reason in (
            (tmp_path / "b", port, "address already in use"),
            (tmp_path / "a", free_port(), "is in use by another kvsplice process"),
        ):
            second = serve(lmdb_dir, listen_port)
            _, stderr = second.communicate(timeout=60)
            lines = stderr.decode().strip().splitlines()
            assert second.returncode == 1
            assert len(lines) == 1 and reason in lines[0], lines
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
