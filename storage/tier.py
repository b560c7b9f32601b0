"""The `StorageTier` protocol every tier implements in full, and its stats snapshot.

Tiers store opaque values under opaque keys, sealed in `record` envelopes; they
know nothing about segments, namespaces, leases or quotas (that is `tiered_store`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Protocol

from kvsplice.storage.record import SealedRecord

EvictionCallback = Callable[[bytes], None]


@dataclass(frozen=True)
class TierStats:
    """Counters of one tier since it was opened (a snapshot; never mutated)."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    checksum_failures: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def __add__(self, other: TierStats) -> TierStats:
        return TierStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


class StorageTier(Protocol):
    """A byte store keyed by bytes. A miss is `None`; faults raise `KvspliceError`s.

    `put` raises `ResourceExhausted` when the value cannot fit (a self-evicting
    tier evicts first and reports each evicted key to its `on_evict` callback);
    `StoreUnavailable` when the backend cannot be reached. A record that fails
    verification is counted in `checksum_failures`, removed and read as a miss.
    """

    name: str

    def put(self, key: bytes, value: bytes | memoryview | SealedRecord) -> None:
        """Store `value` under `key`, replacing any previous value atomically (a
        `SealedRecord` is stored as the record it already is)."""
        ...

    def get(self, key: bytes) -> bytes | memoryview | None:
        """The verified value, or None on a miss (or a record that failed verification)."""
        ...

    def get_prefix(self, key: bytes, max_nbytes: int) -> bytes | None:
        """Up to `max_nbytes` from the start of the value without reading the rest.

        The envelope header is checked (a bad header reads as a miss, like `get`),
        but the bytes themselves are NOT covered by the record checksum: callers
        verify what they read (the segment codec checksums its meta section).
        """
        ...

    def delete(self, key: bytes) -> bool:
        """Remove `key`; True if it was present."""
        ...

    def contains(self, key: bytes) -> bool:
        """True if a record is stored under `key` (not verified)."""
        ...

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        """Every stored key starting with `prefix`, in no promised order."""
        ...

    def used_bytes(self) -> int:
        """Bytes this tier currently holds (each tier documents what it counts)."""
        ...

    def capacity_bytes(self) -> int | None:
        """The most bytes this tier can ever hold (None: no fixed bound known)."""
        ...

    def close(self) -> None:
        """Release resources; idempotent."""
        ...

    def stats(self) -> TierStats:
        """A snapshot of this tier's counters."""
        ...


class TierCounters:
    """Thread-safe mutable counters behind `TierStats` snapshots."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys((f.name for f in fields(TierStats)), 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> TierStats:
        with self._lock:
            return TierStats(**self._values)


class EvictionRelay:
    """An `on_evict` callback whose target is bound later (a store is built after its tiers)."""

    def __init__(self) -> None:
        self._target: EvictionCallback | None = None

    def bind(self, target: EvictionCallback) -> None:
        self._target = target

    def __call__(self, key: bytes) -> None:
        if self._target is not None:
            self._target(key)
