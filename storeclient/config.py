"""Configuration of the store clients: deadlines, retries, chunking, channel options.

Values and validation only. The message-size limit is one chunk plus slack, never
unlimited, like the server's (`max_message_nbytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
MESSAGE_SLACK_NBYTES = 1 * MIB


def max_message_nbytes(chunk_nbytes: int) -> int:
    """Largest gRPC message either side accepts: one chunk plus headers and slack."""
    return chunk_nbytes + MESSAGE_SLACK_NBYTES


@dataclass(frozen=True)
class StoreClientConfig:
    """Per-call deadlines (seconds, spanning retries), retry policy and transport sizes.

    `lookup_timeout_s` covers LookupPrefix/FindSimilar/Stats/anchors, the calls a
    worker makes on its hot path; past it the worker falls back to dense prefill.
    `same_host_reads` lets gets read segments in place when the sidecar runs on this
    host (`storeclient.same_host`); False forces every get over gRPC. `staged_puts` hands
    a put's payload to a sidecar on this host through a file in its staging folder
    (`storeclient.put_staging`) instead of streaming it; False streams every put.
    `receive_pool_bytes` bounds the receive buffers gets over gRPC reuse once callers
    let go of them (`common.buffers.BufferPool`; 0: a fresh buffer per get). `report_interval_s`: how
    often queued reuse reports (`StoreClient.report_reuse`) are sent, in one RPC each.
    """

    lookup_timeout_s: float = 0.5
    get_timeout_s: float = 5.0
    put_timeout_s: float = 10.0
    max_attempts: int = 3
    backoff_initial_s: float = 0.02
    backoff_max_s: float = 0.5
    backoff_multiplier: float = 2.0
    chunk_nbytes: int = 4 * MIB
    warn_interval_s: float = 30.0
    reconnect_backoff_ms: int = 200
    max_reconnect_backoff_ms: int = 5000
    same_host_reads: bool = True
    staged_puts: bool = True
    receive_pool_bytes: int = 256 * MIB
    report_interval_s: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "lookup_timeout_s", "get_timeout_s", "put_timeout_s", "backoff_initial_s",
            "report_interval_s",
        ):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"backoff_max_s {self.backoff_max_s} < backoff_initial_s {self.backoff_initial_s}"
            )
        if self.backoff_multiplier < 1:
            raise ValueError(f"backoff_multiplier must be >= 1, got {self.backoff_multiplier}")
        if not 1 <= self.max_attempts <= 10:
            raise ValueError(f"max_attempts must be in [1, 10], got {self.max_attempts}")
        if not 64 * 1024 <= self.chunk_nbytes <= 64 * MIB:
            raise ValueError(f"chunk_nbytes must be in [64 KiB, 64 MiB], got {self.chunk_nbytes}")
        if self.receive_pool_bytes < 0:
            raise ValueError(f"receive_pool_bytes must be >= 0, got {self.receive_pool_bytes}")
        if self.warn_interval_s < 0:
            raise ValueError(f"warn_interval_s must be >= 0, got {self.warn_interval_s}")
        if not 0 < self.reconnect_backoff_ms <= self.max_reconnect_backoff_ms:
            raise ValueError(
                f"reconnect backoff {self.reconnect_backoff_ms} ms must be in "
                f"(0, max_reconnect_backoff_ms={self.max_reconnect_backoff_ms}]"
            )

    def channel_options(self) -> list[tuple[str, int]]:
        """gRPC channel arguments of the store client."""
        limit = max_message_nbytes(self.chunk_nbytes)
        return [
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # Short reconnect backoff: a restarted store is found again within seconds.
            ("grpc.initial_reconnect_backoff_ms", self.reconnect_backoff_ms),
            ("grpc.min_reconnect_backoff_ms", self.reconnect_backoff_ms),
            ("grpc.max_reconnect_backoff_ms", self.max_reconnect_backoff_ms),
            ("grpc.keepalive_time_ms", 30_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            # NOTE: gRPC shares one connection per address between a process's channels, and
            # its failure with it: a new client would inherit "connection refused" and the
            # backoff of an old one whose store went away, though a store listens there now.
            ("grpc.use_local_subchannel_pool", 1),
        ]


@dataclass(frozen=True)
class ClientTls:
    """TLS toward the store: `ca_path` verifies its certificate (None: the system CAs);
    `cert_path` and `key_path` present a client certificate (mTLS); `server_name`
    overrides the name checked against the certificate (None: the target's host)."""

    ca_path: str | None = None
    cert_path: str | None = None
    key_path: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_path is None) != (self.key_path is None):
            raise ValueError("cert_path and key_path go together (mTLS needs both)")
        for name in ("ca_path", "cert_path", "key_path", "server_name"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must be None or non-empty")
