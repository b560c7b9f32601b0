"""`serve(config)` in a real process: SIGTERM drains, closes LMDB and exits 0 with data intact."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.store import make_meta, make_payload

from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc
from kvsplice.storeclient.wire import put_requests

SERVE = """
import sys
from kvsplice.server.app import serve
from kvsplice.server.embedded import loopback_config
serve(loopback_config(sys.argv[1], listen_address=sys.argv[2]))
"""


def wait_serving(target: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if (
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                time.sleep(0.1)
    raise TimeoutError(f"{target} never became SERVING")


def start_process(lmdb_dir: Path, target: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, "-c", SERVE, str(lmdb_dir), target])
    wait_serving(target)
    return process


@pytest.mark.slow
def test_sigterm_shuts_down_gracefully_and_keeps_the_data(tmp_path: Path) -> None:
    target = f"unix:{tmp_path}/kv.sock"
    payload = make_payload(100_000)
    meta = make_meta([3, 1, 4], payload)
    process = start_process(tmp_path / "lmdb", target)
    try:
        with grpc.insecure_channel(target) as channel:
            store_pb2_grpc.SegmentStoreStub(channel).PutSegment(
                put_requests(meta, payload, 1 << 20), timeout=10
            )
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        process.kill()
    process = start_process(tmp_path / "lmdb", target)
    try:
        with grpc.insecure_channel(target) as channel:
            request = pb.GetSegmentRequest(namespace=meta.namespace, context_key=meta.context_key)
            responses = list(
                store_pb2_grpc.SegmentStoreStub(channel).GetSegment(request, timeout=10)
            )
        assert b"".join(r.chunk for r in responses[1:]) == payload
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
