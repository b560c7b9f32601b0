"""Construction of a `TieredStore` from a `StoreConfig`: the one place tiers are wired.

Local tiers stack fastest first (memory, LMDB); the last one configured is durable.
A Redis/Valkey tier is the shared tier behind them (`SharedTier`), never a local one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvsplice.storage.config import StoreConfig
from kvsplice.storage.lmdb_tier import LMDBTier
from kvsplice.storage.memory_tier import MemoryTier
from kvsplice.storage.shared_tier import SharedTier
from kvsplice.storage.tier import EvictionRelay, StorageTier
from kvsplice.storage.tiered_store import TieredStore


def build_tiered_store(config: StoreConfig, clock: Callable[[], float] = time.time) -> TieredStore:
    # Only a durable memory tier's evictions remove segments; the store is built
    # after its tiers, so that tier reports through a relay bound below.
    relay = EvictionRelay()
    memory_is_durable = config.lmdb is None
    tiers: list[StorageTier] = []
    if config.memory is not None:
        tiers.append(MemoryTier(config.memory, on_evict=relay if memory_is_durable else None))
    if config.lmdb is not None:
        tiers.append(LMDBTier(config.lmdb))
    shared = None if config.redis is None else SharedTier(config.redis)
    try:
        store = TieredStore(config, tiers, clock=clock, shared=shared)
    except BaseException:
        for tier in tiers:
            tier.close()
        if shared is not None:
            shared.close()
        raise
    relay.bind(store.forget_evicted)
    return store
