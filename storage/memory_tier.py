"""The in-process tier: sealed records in a dict under a byte budget, LRU or LFU.

Owns its budget and evicts on its own (reporting keys to `on_evict`); it does not
know whether an evicted key still lives in a lower tier (the store does).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from kvsplice.common.errors import CorruptPayload, ResourceExhausted, StoreUnavailable
from kvsplice.storage.config import MemoryTierConfig
from kvsplice.storage.eviction import make_order
from kvsplice.storage.record import SealedRecord, as_record, body_prefix, open_record
from kvsplice.storage.tier import EvictionCallback, TierCounters, TierStats

logger = logging.getLogger(__name__)


class MemoryTier:
    """`StorageTier` over a dict; `used_bytes` counts sealed records (headers included).

    Every operation is O(1) (dict + `EvictionOrder`) apart from the evictions a
    put needs. The budget is never exceeded, even transiently.
    """

    def __init__(
        self,
        config: MemoryTierConfig,
        on_evict: EvictionCallback | None = None,
        name: str = "memory",
    ) -> None:
        self.name = name
        self._config = config
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._records: dict[bytes, bytes] = {}
        self._order = make_order(config.policy)
        self._used_nbytes = 0
        self._counters = TierCounters()
        self._closed = False

    def put(self, key: bytes, value: bytes | memoryview | SealedRecord) -> None:
        record = bytes(as_record(value, self._config.compress))  # kept past this call
        if len(record) > self._config.max_bytes:
            raise ResourceExhausted(
                f"{self.name}: record of {len(record)} bytes exceeds the budget "
                f"of {self._config.max_bytes} bytes"
            )
        with self._lock:
            self._check_open()
            self._drop(key)
            evicted = self._make_room(len(record))
            self._records[key] = record
            self._order.add(key)
            self._used_nbytes += len(record)
        self._counters.add(puts=1, bytes_in=len(value), evictions=len(evicted))
        for evicted_key in evicted:
            if self._on_evict is not None:
                self._on_evict(evicted_key)

    def get(self, key: bytes) -> bytes | memoryview | None:
        record = self._lookup(key)
        if record is None:
            return None
        try:
            body = open_record(record)
        except CorruptPayload as exc:
            self._discard_corrupt(key, record, exc)
            return None
        self._counters.add(hits=1, bytes_out=len(body))
        return body

    def get_prefix(self, key: bytes, max_nbytes: int) -> bytes | None:
        with self._lock:
            self._check_open()
            record = self._records.get(key)
        if record is None:
            return None
        try:
            return body_prefix(record, max_nbytes)
        except CorruptPayload as exc:
            self._discard_corrupt(key, record, exc)
            return None

    def delete(self, key: bytes) -> bool:
        with self._lock:
            self._check_open()
            return self._drop(key)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            self._check_open()
            return key in self._records

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        with self._lock:
            self._check_open()
            snapshot = [key for key in self._records if key.startswith(prefix)]
        return iter(snapshot)

    def used_bytes(self) -> int:
        with self._lock:
            return self._used_nbytes

    def capacity_bytes(self) -> int | None:
        return self._config.max_bytes

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._records.clear()
            self._order = make_order(self._config.policy)
            self._used_nbytes = 0

    def stats(self) -> TierStats:
        return self._counters.snapshot()

    def _lookup(self, key: bytes) -> bytes | None:
        with self._lock:
            self._check_open()
            record = self._records.get(key)
            if record is not None:
                self._order.touch(key)
        if record is None:
            self._counters.add(misses=1)
        return record

    def _make_room(self, nbytes: int) -> list[bytes]:
        """Evict in policy order until `nbytes` more fit; caller holds the lock."""
        evicted = []
        while self._used_nbytes + nbytes > self._config.max_bytes:
            victim = self._order.victim()
            if victim is None:  # pragma: no cover - nbytes <= max_bytes was checked
                raise ResourceExhausted(f"{self.name}: nothing left to evict")
            self._drop(victim)
            evicted.append(victim)
        return evicted

    def _drop(self, key: bytes) -> bool:
        """Forget `key`; caller holds the lock."""
        record = self._records.pop(key, None)
        if record is None:
            return False
        self._order.discard(key)
        self._used_nbytes -= len(record)
        return True

    def _discard_corrupt(self, key: bytes, record: bytes, exc: CorruptPayload) -> None:
        with self._lock:
            if self._records.get(key) is record:  # not replaced meanwhile
                self._drop(key)
        self._counters.add(checksum_failures=1, misses=1)
        logger.warning("%s: dropped corrupt record %s: %s", self.name, key.hex(), exc)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable(f"{self.name} tier is closed")
