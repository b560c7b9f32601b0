"""Configuration of the storage tiers and the tiered store, and `build_store`.

Each component gets one frozen dataclass validated on construction; environment
variables and CLI flags are read elsewhere (the server's entry point).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvsplice.common.config_flags import MIB, flag
from kvsplice.common.segment import validate_namespace

if TYPE_CHECKING:
    from kvsplice.storage.tiered_store import TieredStore

EVICTION_POLICIES = ("lru", "lfu")


def _positive(name: str, value: float | None) -> None:
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} {value!r} must be a positive finite number")


@dataclass(frozen=True)
class MemoryTierConfig:
    """A byte-budgeted in-process tier; `policy` picks what it evicts first."""

    max_bytes: int = flag(
        MISSING, "Memory tier budget; 0 disables it.",
        name="memory-mib", mib=True, min=0, cli_default=1024 * MIB, switch=True,
    )  # fmt: skip
    policy: str = flag(
        "lru", "What the memory tier evicts first.", name="memory-policy", choices=EVICTION_POLICIES
    )
    compress: bool = False

    def __post_init__(self) -> None:
        _positive("max_bytes", self.max_bytes)
        if self.policy not in EVICTION_POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {EVICTION_POLICIES}")


@dataclass(frozen=True)
class LMDBTierConfig:
    """The durable tier: an LMDB environment directory of at most `map_size_bytes`."""

    path: str = flag(
        MISSING, "Durable tier directory (created).",
        name="lmdb-path", path=True, cli_default="kvsplice-data/lmdb", switch=True,
    )  # fmt: skip
    map_size_bytes: int = flag(
        1 << 30, "LMDB tier budget (its map size).",
        name="lmdb-map-size-mib", mib=True, min=1, cli_default=4096 * MIB,
    )  # fmt: skip
    compress: bool = flag(False, "zstd on the LMDB tier (rarely pays on int8 KV).")
    sync: bool = flag(
        True, "fsync what the LMDB tier commits (per commit, or per sync window).",
        name="lmdb-sync",
    )  # fmt: skip
    sync_interval_ms: float = flag(
        100.0, "LMDB fsync window: commits are fsynced together at most this often "
        "(0: every commit).", name="lmdb-sync-interval-ms", min=0,
    )  # fmt: skip
    max_unsynced_bytes: int = flag(
        256 * MIB, "A put that leaves more unsynced than this fsyncs before it is acknowledged.",
        name="lmdb-max-unsynced-mib", mib=True, min=1,
    )  # fmt: skip
    writemap: bool = flag(
        True, "Write LMDB records straight into its map (no staging copy of the pages).",
        name="lmdb-writemap",
    )  # fmt: skip
    payload_file_min_nbytes: int = flag(
        1 * MIB, "A staged payload this large is adopted as a file beside LMDB (renamed in "
        "from the staging folder: no copy) where both share a filesystem; 0: always copied.",
        name="lmdb-payload-file-min-mib", mib=True, min=0,
    )  # fmt: skip

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError(f"path {self.path!r} is empty")
        if self.map_size_bytes < 64 * 1024:
            raise ValueError(f"map_size_bytes {self.map_size_bytes} is below 64 KiB")
        if not (math.isfinite(self.sync_interval_ms) and self.sync_interval_ms >= 0):
            raise ValueError(f"sync_interval_ms {self.sync_interval_ms!r} must be finite, >= 0")
        if self.max_unsynced_bytes < 1:
            raise ValueError(f"max_unsynced_bytes {self.max_unsynced_bytes} must be >= 1")
        if self.payload_file_min_nbytes < 0:
            raise ValueError(f"payload_file_min_nbytes {self.payload_file_min_nbytes} is < 0")

    @property
    def adopts_payload_files(self) -> bool:
        """Staged payloads (large enough) become files beside the map, not copies in it."""
        return self.payload_file_min_nbytes > 0 and not self.compress

    @property
    def grouped_sync(self) -> bool:
        """Commits are fsynced together by a sync window, not one by one."""
        return self.sync and self.sync_interval_ms > 0


def describe_durability(config: LMDBTierConfig) -> str:
    """What an acknowledged put of this tier survives, in one line (bench JSON, logs)."""
    pages = "writemap" if config.writemap else "no writemap"
    if config.adopts_payload_files:
        pages += f", staged payloads >= {config.payload_file_min_nbytes / MIB:g} MiB as files"
    if not config.sync:
        return f"no fsync (page cache; fsync at close), {pages}"
    if not config.grouped_sync:
        return f"fsync every commit, {pages}"
    return (
        f"fsync every {config.sync_interval_ms:g} ms or "
        f"{config.max_unsynced_bytes / MIB:g} MiB unsynced, {pages}"
    )


REDIS_SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://", "unix://")


@dataclass(frozen=True)
class RedisTierConfig:
    """The shared Redis/Valkey tier (one server, or a Cluster reached through any seed node).

    Records are one key each under `key_prefix`; put/delete/evict events travel on one
    stream per namespace trimmed to about `stream_max_len` events. Every call has
    `socket_timeout_s`; `failure_threshold` consecutive faults mark the tier degraded
    until a probe every `probe_interval_s` succeeds. While degraded, at most
    `max_pending_publish` written keys wait to be shared (the oldest are dropped).
    """

    url: str = flag(
        "redis://127.0.0.1:6379/0",
        "Shared Redis/Valkey tier: redis://, rediss://, valkey:// (a cluster takes "
        "host:port,host:port seeds). Unreachable at start: serve degraded, connect later.",
        name="redis-url", cli_default=None, switch=True,
    )  # fmt: skip
    cluster: bool = flag(
        False, "--redis-url names seed nodes of a Redis/Valkey Cluster.", name="redis-cluster"
    )
    read_from_replicas: bool = flag(
        False, "Cluster reads may go to replicas.", name="redis-read-replicas"
    )
    key_prefix: str = "kvsplice:"
    compress: bool = False
    ttl_s: float | None = None
    socket_timeout_s: float = 0.5
    max_bytes: int | None = None  # what `capacity_bytes()` reports; None = unbounded
    failure_threshold: int = 2
    probe_interval_s: float = 0.5
    stream_max_len: int = 100_000
    max_pending_publish: int = 100_000

    def __post_init__(self) -> None:
        if not self.url.startswith(REDIS_SCHEMES):
            # the scheme only: a URL may carry a password
            scheme = self.url.split("://", 1)[0] if "://" in self.url else self.url[:16]
            raise ValueError(f"url scheme {scheme!r} is not one of {', '.join(REDIS_SCHEMES)}")
        if self.cluster and self.url.startswith("unix://"):
            raise ValueError("a Redis Cluster is reached over TCP, not a unix:// socket")
        if not self.key_prefix or any(c in self.key_prefix for c in "{}"):
            raise ValueError(f"key_prefix {self.key_prefix!r} is empty or holds a brace")
        _positive("ttl_s", self.ttl_s)
        _positive("socket_timeout_s", self.socket_timeout_s)
        _positive("max_bytes", self.max_bytes)
        _positive("probe_interval_s", self.probe_interval_s)
        for name in ("failure_threshold", "stream_max_len", "max_pending_publish"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")


@dataclass(frozen=True)
class RetentionRules:
    """The online rules eviction applies beside the lease itself while sessions hold segments
    (docs/operations.md, "Sessions"); each can be turned off to measure it alone (the
    replay's ablation). None applies while no session holds anything: eviction is LRU.

    `tails_first`: a held segment its session went on without (neither extended nor read
    again since a later hold of the session) goes right after the released ones.
    `leaves_first`: a held segment goes after its held descendants (evicting it would strand
    them). `reused_last`: a segment without a session that was read again, or put again
    within `max_remembered` evictions of its own, goes after the other unheld ones (before
    the held ones): one-shot prompts do not flush a shared document's prefix. `forecast`:
    those re-used unheld segments and the held ones go together, the furthest forecast next
    use first (`reuse_forecast`: a held segment by its session's next request, learned from
    the waits and expiries of every session; an unheld one by its own uses): a session gone
    quiet for longer than sessions come back after goes before a document read every minute.
    """

    tails_first: bool = True
    leaves_first: bool = True
    reused_last: bool = True
    forecast: bool = True
    max_remembered: int = 65_536  # keys of the latest evictions (0: none)

    def __post_init__(self) -> None:
        if self.max_remembered < 0:
            raise ValueError(f"max_remembered {self.max_remembered} must be >= 0")


@dataclass(frozen=True)
class SessionConfig:
    """Session leases: a segment a live session put or looked up is held `lease_s` after the
    session's last request (0: sessions off, every session id ignored); a retain hint may ask
    for up to `max_lease_s`. A namespace's held bytes stay within its quota."""

    lease_s: float = flag(
        300.0, "Hold a session's segments this long after its last request (0: off).",
        name="session-lease-s", min=0,
    )  # fmt: skip
    max_lease_s: float = flag(
        3600.0, "Longest lease a retain hint may ask for (longer is clipped).",
        name="session-max-lease-s", min=0,
    )  # fmt: skip
    rules: RetentionRules = field(default_factory=RetentionRules)

    def __post_init__(self) -> None:
        for name in ("lease_s", "max_lease_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} {value!r} must be a finite number >= 0")


@dataclass(frozen=True)
class StoreConfig:
    """The tiered store: local tiers (memory over LMDB, the last durable), the optional
    shared tier (`redis`: one server or a Cluster shared by every sidecar), quotas.

    A namespace's quota is `namespace_quota_bytes[ns]`, else `default_quota_bytes`
    (None: no quota). Quotas cap the bytes of segment records (meta + payload).
    `cache_puts`: a segment put is copied into the cache tiers above the durable one too;
    off, they hold what reads promote (a same-host reader reads LMDB's map in place,
    so a memory copy of every put would be a second resident copy nobody reads).
    """

    memory: MemoryTierConfig | None = None
    lmdb: LMDBTierConfig | None = None
    redis: RedisTierConfig | None = None
    namespace_quota_bytes: Mapping[str, int] = field(default_factory=dict)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    default_quota_bytes: int | None = flag(
        None, "Per-namespace byte quota.", name="quota-mib", mib=True, min=1
    )
    cache_puts: bool = flag(
        False, "Also copy each put into the memory tier above LMDB (else reads promote).",
        name="memory-cache-puts",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.memory is None and self.lmdb is None:
            raise ValueError("StoreConfig names no local tier (memory and lmdb are both None)")
        _positive("default_quota_bytes", self.default_quota_bytes)
        for namespace, quota in self.namespace_quota_bytes.items():
            validate_namespace(namespace)
            _positive(f"namespace_quota_bytes[{namespace!r}]", quota)
        object.__setattr__(
            self, "namespace_quota_bytes", MappingProxyType(dict(self.namespace_quota_bytes))
        )

    def quota_for(self, namespace: str) -> int | None:
        return self.namespace_quota_bytes.get(namespace, self.default_quota_bytes)


def build_store(config: StoreConfig, clock: Callable[[], float] | None = None) -> TieredStore:
    """Open the configured tiers (memory, then LMDB; Redis shared behind) and the store
    (`clock`: its wall clock, for TTLs and session leases; a replay passes its own)."""
    # NOTE: imported here because every tier module imports this one for its config.
    from kvsplice.storage.build import build_tiered_store

    return build_tiered_store(config) if clock is None else build_tiered_store(config, clock)
