"""Configuration of the storage tiers and the tiered store, and `build_store`.

Each component gets one frozen dataclass validated on construction; environment
variables and CLI flags are read elsewhere (the server's entry point).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

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

    max_bytes: int
    policy: str = "lru"
    compress: bool = False

    def __post_init__(self) -> None:
        _positive("max_bytes", self.max_bytes)
        if self.policy not in EVICTION_POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {EVICTION_POLICIES}")


@dataclass(frozen=True)
class LMDBTierConfig:
    """The durable tier: an LMDB environment directory of at most `map_size_bytes`."""

    path: str
    map_size_bytes: int = 1 << 30
    compress: bool = False
    sync: bool = True

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError(f"path {self.path!r} is empty")
        if self.map_size_bytes < 64 * 1024:
            raise ValueError(f"map_size_bytes {self.map_size_bytes} is below 64 KiB")


@dataclass(frozen=True)
class RedisTierConfig:
    """A Redis/Valkey tier: one key per record under `key_prefix`."""

    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kvsplice:"
    compress: bool = False
    ttl_s: float | None = None
    socket_timeout_s: float = 5.0
    max_bytes: int | None = None  # what `capacity_bytes()` reports; None = unbounded

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url {self.url!r} is not a redis://, rediss:// or unix:// URL")
        if not self.key_prefix:
            raise ValueError(f"key_prefix {self.key_prefix!r} is empty")
        _positive("ttl_s", self.ttl_s)
        _positive("socket_timeout_s", self.socket_timeout_s)
        _positive("max_bytes", self.max_bytes)


@dataclass(frozen=True)
class StoreConfig:
    """The tiered store: which tiers (fastest first, LMDB durable), quotas per namespace.

    A namespace's quota is `namespace_quota_bytes[ns]`, else `default_quota_bytes`
    (None: no quota). Quotas cap the bytes of segment records (meta + payload).
    """

    memory: MemoryTierConfig | None = None
    lmdb: LMDBTierConfig | None = None
    redis: RedisTierConfig | None = None
    namespace_quota_bytes: Mapping[str, int] = field(default_factory=dict)
    default_quota_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.memory is None and self.lmdb is None and self.redis is None:
            raise ValueError("StoreConfig names no tier (memory, lmdb and redis are all None)")
        _positive("default_quota_bytes", self.default_quota_bytes)
        for namespace, quota in self.namespace_quota_bytes.items():
            validate_namespace(namespace)
            _positive(f"namespace_quota_bytes[{namespace!r}]", quota)
        object.__setattr__(
            self, "namespace_quota_bytes", MappingProxyType(dict(self.namespace_quota_bytes))
        )

    def quota_for(self, namespace: str) -> int | None:
        return self.namespace_quota_bytes.get(namespace, self.default_quota_bytes)


def build_store(config: StoreConfig) -> TieredStore:
    """Open the configured tiers (memory, then Redis, then LMDB) and the store over them."""
    # NOTE: imported here because every tier module imports this one for its config.
    from kvsplice.storage.build import build_tiered_store

    return build_tiered_store(config)
