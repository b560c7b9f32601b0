"""Configuration of the store sidecar: the service's limits and the server around it.

`ServerConfig` nests the component configs (tiers, indexes, limits) plus transport
settings; the CLI fills it, `server.app.build` reads it. No flags or env vars here.
"""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field

from kvsplice.common.config_flags import MIB, existing_file_flag, flag
from kvsplice.common.segment import MAX_SEGMENT_TOKENS
from kvsplice.common.staging import AUTO_STAGING_DIR
from kvsplice.index.anchor_pool import AnchorPoolConfig
from kvsplice.index.exact_index import ExactIndexConfig
from kvsplice.index.similarity_config import SimilarityConfig
from kvsplice.server.kv_event_publisher import KvEventsConfig
from kvsplice.storage.config import MemoryTierConfig, StoreConfig

# Must equal the client's `storeclient.config.MESSAGE_SLACK_NBYTES`: both sides accept
# one chunk plus this much (headers, token lists), never unlimited messages.
MESSAGE_SLACK_NBYTES = 1 * MIB
_TCP_ADDRESS = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):\d{1,5}$")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class SegmentServiceConfig:
    """What the service accepts: sizes, token counts, result limits, the default TTL."""

    # 64 MiB: a 512-token segment of an 8B GQA model in fp16 (32 layers x 8 KV heads x 128
    # x K,V x 2 B = 128 KiB/token), 1,400 tokens of SmolLM2-135M in fp32 (45 KiB/token).
    max_payload_nbytes: int = flag(
        64 * MIB,
        "Largest accepted segment payload (64: a 512-token segment of an 8B model, fp16).",
        name="max-payload-mib", mib=True, min=1,
    )  # fmt: skip
    max_segment_tokens: int = 65_536
    max_query_tokens: int = 262_144
    max_index_text_chars: int = 262_144
    max_layers: int = 1024
    max_labels: int = 32
    default_ttl_s: float | None = flag(None, "TTL of segments put without one (none: keep).")
    default_similar_limit: int = 8
    max_similar_limit: int = 64
    max_anchor_nbytes: int = 256 * MIB  # one anchor's payloads (streamed in chunks)
    max_agents_per_anchor: int = 64

    def __post_init__(self) -> None:
        for name in (
            "max_payload_nbytes", "max_segment_tokens", "max_query_tokens", "max_index_text_chars",
            "max_layers", "default_similar_limit", "max_similar_limit", "max_anchor_nbytes",
            "max_agents_per_anchor",
        ):  # fmt: skip
            _require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _require(self.max_labels >= 0, f"max_labels must be >= 0, got {self.max_labels}")
        _require(
            self.max_segment_tokens <= MAX_SEGMENT_TOKENS,
            f"max_segment_tokens {self.max_segment_tokens} > {MAX_SEGMENT_TOKENS}",
        )
        _require(
            self.default_similar_limit <= self.max_similar_limit,
            f"default_similar_limit {self.default_similar_limit} > max_similar_limit {self.max_similar_limit}",
        )
        ttl = self.default_ttl_s
        _require(
            ttl is None or (ttl > 0 and math.isfinite(ttl)),
            f"default_ttl_s {ttl!r} must be None or a positive number",
        )


@dataclass(frozen=True)
class TlsConfig:
    """TLS for gRPC and the admin API: PEM files; `client_ca_path` set means mTLS (a client
    certificate signed by that CA is required)."""

    cert_path: str = flag(
        MISSING, "Server certificate (PEM): TLS.",
        name="tls-cert", path=True, exists=True, cli_default=None, switch=True,
    )  # fmt: skip
    key_path: str = flag(
        MISSING, "Its private key (PEM).",
        name="tls-key", path=True, exists=True, cli_default=None, switch=True,
    )  # fmt: skip
    client_ca_path: str | None = flag(
        None, "Require client certificates signed by this CA (mTLS).",
        name="tls-client-ca", path=True, exists=True,
    )  # fmt: skip

    def __post_init__(self) -> None:
        for name in ("cert_path", "key_path", "client_ca_path"):
            value = getattr(self, name)
            _require(value is None or bool(value), f"{name} must be a path, got {value!r}")


def _default_store() -> StoreConfig:
    return StoreConfig(memory=MemoryTierConfig(max_bytes=1 << 30))


@dataclass(frozen=True)
class ServerConfig:
    """The gRPC sidecar: where it listens, what it stores, who may call it.

    `listen_address` is `host:port` (port 0 picks a free one) or `unix:/path`.
    `auth_token`, when set, is one admin credential (`authorization: Bearer <token>`);
    `tenants_path` names a tenants file (`server.tenants`); with neither, no auth.
    `grace_period_s` bounds how long shutdown waits for in-flight RPCs.
    The admin HTTP API (health, metrics, stats) runs on the same event loop when
    `admin_port` is set, guarded by the same credentials and TLS.
    An upload silent for `stream_idle_timeout_s` is cut; uploads in flight may declare
    at most `max_inflight_upload_nbytes` payload bytes together.
    With a shared tier, start waits up to `catch_up_timeout_s` for the streams' history
    while the tier faults (a failover), before it reports ready.
    """

    listen_address: str = flag(
        "127.0.0.1:50051", "gRPC address: host:port or unix:/path.", name="listen"
    )
    store: StoreConfig = field(default_factory=_default_store)
    exact_index: ExactIndexConfig = field(default_factory=ExactIndexConfig)
    similarity: SimilarityConfig = field(default_factory=SimilarityConfig)
    anchor_pool: AnchorPoolConfig = field(default_factory=AnchorPoolConfig)
    service: SegmentServiceConfig = field(default_factory=SegmentServiceConfig)
    auth_token: str | None = flag(None, "One admin token ('Bearer <token>') on every call.")
    tenants_path: str | None = existing_file_flag(
        "Tenants file (kvsplice tenants add): namespaces and role per token hash; "
        "re-read on SIGHUP.",
        name="tenants",
    )
    tls: TlsConfig | None = None
    kv_events: KvEventsConfig | None = None  # None: no KV event stream
    stream_idle_timeout_s: float = flag(
        10.0, "Cut an upload (or a GetSegment reader) silent this long.", min=0.1
    )
    max_inflight_upload_nbytes: int = flag(
        256 * MIB, "Payload MiB all uploads in progress may declare together.",
        name="max-inflight-upload-mib", mib=True, min=1,
    )  # fmt: skip
    chunk_nbytes: int = flag(
        4 * MIB, "Stream frame size of payloads.", name="chunk-mib", mib=True, min=1, max=64
    )
    grace_period_s: float = flag(10.0, "On SIGTERM, how long in-flight RPCs may drain.", min=0)
    pid_file: str | None = flag(
        None,
        "Write the sidecar's pid here once it listens (removed on a clean exit), for "
        "`kill -HUP` and service managers; refused if it holds a running process's pid.",
        path=True,
    )
    staging_dir: str | None = flag(
        AUTO_STAGING_DIR,
        "Folder where clients on this host hand over a put's payload in a file instead of "
        "streaming it; 'auto': inside the LMDB directory (adopted as the payload's file, no "
        "copy), else /dev/shm; '' streams only. Off by itself where missing.",
    )
    sweep_interval_s: float = 60.0
    # How often reported reuse is written into the tiers (and at shutdown): a SIGKILL loses
    # at most what was reported in the last interval.
    persist_interval_s: float = 5.0
    catch_up_timeout_s: float = 30.0
    max_concurrent_rpcs: int | None = None
    enable_reflection: bool = True
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None  # None: no admin HTTP API; 0: a free port

    def __post_init__(self) -> None:
        address = self.listen_address
        is_unix = address.startswith("unix:") and len(address) > len("unix:")
        _require(
            is_unix or bool(_TCP_ADDRESS.match(address)),
            f"listen_address {address!r} is neither host:port nor unix:/path",
        )
        _require(
            self.auth_token is None or (bool(self.auth_token) and self.auth_token.isprintable()),
            "auth_token must be None or a non-empty printable string",
        )
        _require(
            self.tenants_path is None or bool(self.tenants_path),
            f"tenants_path must be None or a path, got {self.tenants_path!r}",
        )
        _require(
            0 < self.stream_idle_timeout_s < math.inf,
            f"stream_idle_timeout_s must be > 0 and finite, got {self.stream_idle_timeout_s}",
        )
        _require(
            self.max_inflight_upload_nbytes >= self.service.max_payload_nbytes,
            f"max_inflight_upload_nbytes {self.max_inflight_upload_nbytes} < "
            f"service.max_payload_nbytes {self.service.max_payload_nbytes}",
        )
        _require(
            64 * 1024 <= self.chunk_nbytes <= 64 * MIB,
            f"chunk_nbytes must be in [64 KiB, 64 MiB], got {self.chunk_nbytes}",
        )
        _require(
            self.pid_file is None or bool(self.pid_file),
            f"pid_file must be None or a path, got {self.pid_file!r}",
        )
        _require(
            self.grace_period_s >= 0, f"grace_period_s must be >= 0, got {self.grace_period_s}"
        )
        _require(
            self.sweep_interval_s > 0, f"sweep_interval_s must be > 0, got {self.sweep_interval_s}"
        )
        _require(
            0 < self.persist_interval_s < math.inf,
            f"persist_interval_s must be > 0 and finite, got {self.persist_interval_s}",
        )
        _require(
            0 <= self.catch_up_timeout_s < math.inf,
            f"catch_up_timeout_s must be >= 0 and finite, got {self.catch_up_timeout_s}",
        )
        _require(
            self.max_concurrent_rpcs is None or self.max_concurrent_rpcs > 0,
            f"max_concurrent_rpcs must be None or > 0, got {self.max_concurrent_rpcs}",
        )
        _require(
            self.admin_port is None or 0 <= self.admin_port <= 65535,
            f"admin_port must be None or in [0, 65535], got {self.admin_port}",
        )

    @property
    def max_message_nbytes(self) -> int:
        """Largest gRPC message the server sends or accepts: one chunk plus slack."""
        return self.chunk_nbytes + MESSAGE_SLACK_NBYTES
