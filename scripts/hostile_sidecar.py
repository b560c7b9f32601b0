"""The sidecar a hostile audit runs against: `kvsplice serve` in a subprocess, and what reads it.

Owns the audit's tenants and tokens, the segments it writes and the status a call ends
with; the hostile requests are `hostile_requests`', the audits `hostile_audit`'s.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsplice.common.keys import root_key
from kvsplice.common.segment import SegmentMeta, chained_meta
from kvsplice.proto import store_pb2 as pb
from kvsplice.storeclient.wire import with_payload_digest

FINGERPRINT = "kvfp1-" + "7" * 32
TOKENS = {"team-a": "audit-token-a", "team-b": "audit-token-b"}
KVSPLICE = [sys.executable, "-c", "from kvsplice.cli import main; main()"]
# One 4 MiB chunk plus framing, as the real clients allow (`store_config.max_message_nbytes`).
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 8 << 20)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def bearer(namespace: str | None) -> tuple[tuple[str, str], ...]:
    return () if namespace is None else (("authorization", f"Bearer {TOKENS[namespace]}"),)


def segment(namespace: str, tokens: tuple[int, ...], payload: bytes, **extra: Any) -> SegmentMeta:
    meta = chained_meta(namespace, FINGERPRINT, root_key(FINGERPRINT), tokens, 0, 30, **extra)
    return with_payload_digest(meta, payload)


class Sidecar:
    """`kvsplice serve` in a subprocess, its log in a file."""

    def __init__(self, workdir: Path, *flags: str, admin: bool = True, port: int = 0) -> None:
        self.port, self.admin_port = port or free_port(), free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.log_path = workdir / f"serve-{self.port}.log"
        admin_listen = f"127.0.0.1:{self.admin_port}" if admin else "off"
        command = [*KVSPLICE, "serve", "--listen", self.target, "--admin-listen", admin_listen]
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [*command, *flags], stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
        self.wait_serving()

    def wait_serving(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                try:
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    return
                except grpc.RpcError:
                    time.sleep(0.1)
        raise TimeoutError(f"{self.target} never served")

    def is_serving(self) -> bool:
        with grpc.insecure_channel(self.target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)
        self.process.wait(60)
        self._log.close()


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def read_payload(stub: Any, meta: SegmentMeta, namespace: str | None = None) -> bytes | None:
    request = pb.GetSegmentRequest(namespace=meta.namespace, context_key=meta.context_key)
    try:
        replies = list(
            stub.GetSegment(request, metadata=bearer(namespace or meta.namespace), timeout=10)
        )
    except grpc.RpcError:
        return None
    return b"".join(r.chunk for r in replies[1:])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan
