"""The store's in-memory mirror of the durable tier's segments.

Owns recency (global and per-namespace LRU order), per-namespace usage and
lookup counters, quota reservations, leases and TTL deadlines. It does no I/O
and takes no locks: `TieredStore` calls it under its own lock.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from kvsplice.common.segment import SegmentMeta


class Retention(Protocol):
    """Reranks the catalog's LRU order for eviction (`storage.sessions.SessionLeases`)."""

    def eviction_order(
        self, lru_keys: Iterable[bytes], in_scope: Callable[[bytes], bool]
    ) -> Iterable[bytes]: ...

    def touched(self, key: bytes) -> None: ...

    def inserted(self, key: bytes) -> None: ...


@dataclass(frozen=True)
class CatalogEntry:
    meta: SegmentMeta
    body_nbytes: int  # meta + payload as stored: the unit of quotas
    meta_digest: int  # identifies this version of the record in every tier

    @property
    def expires_at_s(self) -> float | None:
        ttl_s = self.meta.ttl_s
        return None if ttl_s is None else self.meta.created_at_s + ttl_s


@dataclass(frozen=True)
class NamespaceUsage:
    segments: int
    bytes: int
    hits: int
    misses: int


class Catalog:
    """Segments by tier key, least recently used first (globally and per namespace)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[bytes, CatalogEntry] = OrderedDict()
        self._namespace_order: dict[str, OrderedDict[bytes, None]] = {}
        self._namespace_bytes: Counter[str] = Counter()
        self._reserved_bytes: Counter[str] = Counter()
        self._hits: Counter[str] = Counter()
        self._misses: Counter[str] = Counter()
        self._leases: Counter[bytes] = Counter()
        self._doomed: set[bytes] = set()
        self._deadlines: list[tuple[float, bytes, int]] = []  # heap; stale items skipped
        self.retention: Retention | None = None  # None: eviction is LRU order as it stands

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> CatalogEntry | None:
        return self._entries.get(key)

    def insert(self, key: bytes, entry: CatalogEntry) -> CatalogEntry | None:
        """Add or replace `key` as the most recently used; returns the replaced entry."""
        old = self.pop(key)
        namespace = entry.meta.namespace
        self._entries[key] = entry
        if self.retention is not None:
            self.retention.inserted(key)
        self._namespace_order.setdefault(namespace, OrderedDict())[key] = None
        self._namespace_bytes[namespace] += entry.body_nbytes
        if entry.expires_at_s is not None:
            heapq.heappush(self._deadlines, (entry.expires_at_s, key, entry.meta_digest))
        return old

    def pop(self, key: bytes) -> CatalogEntry | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        namespace = entry.meta.namespace
        order = self._namespace_order[namespace]
        del order[key]
        if not order:
            del self._namespace_order[namespace]
        self._namespace_bytes[namespace] -= entry.body_nbytes
        self._doomed.discard(key)
        return entry

    def touch(self, key: bytes) -> None:
        entry = self._entries[key]
        if self.retention is not None:
            self.retention.touched(key)
        self._entries.move_to_end(key)
        self._namespace_order[entry.meta.namespace].move_to_end(key)

    def record_lookup(self, namespace: str, hit: bool) -> None:
        (self._hits if hit else self._misses)[namespace] += 1

    def used_bytes(self, namespace: str) -> int:
        """Committed plus reserved bytes of `namespace`."""
        return self._namespace_bytes[namespace] + self._reserved_bytes[namespace]

    def reserve(self, namespace: str, nbytes: int) -> None:
        self._reserved_bytes[namespace] += nbytes

    def unreserve(self, namespace: str, nbytes: int) -> None:
        self._reserved_bytes[namespace] -= nbytes

    def lease(self, key: bytes) -> None:
        self._leases[key] += 1

    def release(self, key: bytes) -> bool:
        """End one lease; True if it was the last one on a segment doomed meanwhile."""
        self._leases[key] -= 1
        if self._leases[key] > 0:
            return False
        del self._leases[key]
        return key in self._doomed

    def is_leased(self, key: bytes) -> bool:
        return self._leases[key] > 0

    def doom(self, key: bytes) -> None:
        """Mark a leased segment for removal when its last lease ends."""
        self._doomed.add(key)

    def is_doomed(self, key: bytes) -> bool:
        return key in self._doomed

    def lru_victims(
        self,
        namespace: str | None,
        nbytes: int,
        exclude: bytes,
        try_claim: Callable[[bytes], bool],
    ) -> list[tuple[bytes, CatalogEntry]]:
        """Unleased segments worth >= `nbytes` (fewer if there are none), LRU first.

        Scans one namespace or all; skips `exclude` and keys `try_claim` refuses
        (it claims the ones it accepts). The catalog itself is left unchanged.
        """
        victims: list[tuple[bytes, CatalogEntry]] = []
        freed = 0
        for key in self._victim_keys(namespace):
            if freed >= nbytes:
                break
            if key == exclude or self.is_leased(key) or not try_claim(key):
                continue
            entry = self._entries[key]
            victims.append((key, entry))
            freed += entry.body_nbytes
        return victims

    def fair_victims(
        self,
        writer: str | None,
        nbytes: int,
        exclude: bytes,
        try_claim: Callable[[bytes], bool],
    ) -> list[tuple[bytes, CatalogEntry]]:
        """Unleased segments worth >= `nbytes` (fewer if there are none), each the LRU one
        of the namespace holding the most bytes at that point, `writer` counted with the
        `nbytes` it is writing (ties go to the writer).

        NOTE: every namespace has an equal share of the tier, so the one holding the most
        is the one furthest over its share: a writer under its share takes room from the
        largest namespace until both are even, then pays with its own oldest segments.
        """
        usage = Counter(self._namespace_bytes)
        if writer is not None:
            usage[writer] += nbytes
        candidates = {ns: iter(self._victim_keys(ns)) for ns in self._namespace_order}
        victims: list[tuple[bytes, CatalogEntry]] = []
        freed = 0
        while freed < nbytes and candidates:
            namespace = max(candidates, key=lambda ns: (usage[ns], ns == writer))
            key = next(candidates[namespace], None)
            if key is None:
                del candidates[namespace]
                continue
            if key == exclude or self.is_leased(key) or not try_claim(key):
                continue
            entry = self._entries[key]
            victims.append((key, entry))
            freed += entry.body_nbytes
            usage[namespace] -= entry.body_nbytes
        return victims

    def due_keys(self, now_s: float) -> list[bytes]:
        """Pop the keys whose TTL deadline passed (entries replaced since are skipped)."""
        due = []
        while self._deadlines and self._deadlines[0][0] < now_s:
            _, key, digest = heapq.heappop(self._deadlines)
            entry = self._entries.get(key)
            if entry is not None and entry.meta_digest == digest:
                due.append(key)
        return due

    def metas(self, namespace: str | None = None) -> list[SegmentMeta]:
        return [self._entries[key].meta for key in self._ordered_keys(namespace)]

    def usage(self) -> dict[str, NamespaceUsage]:
        namespaces = set(self._namespace_order) | set(self._hits) | set(self._misses)
        return {
            ns: NamespaceUsage(
                segments=len(self._namespace_order.get(ns, ())),
                bytes=self._namespace_bytes[ns],
                hits=self._hits[ns],
                misses=self._misses[ns],
            )
            for ns in sorted(namespaces)
        }

    def _victim_keys(self, namespace: str | None) -> Iterable[bytes]:
        """Eviction candidates of one namespace or all, first to go first."""
        keys = self._ordered_keys(namespace)
        if self.retention is None:
            return keys
        entries = self._entries

        def in_scope(key: bytes) -> bool:
            entry = entries.get(key)
            return entry is not None and (namespace is None or entry.meta.namespace == namespace)

        return self.retention.eviction_order(keys, in_scope)

    def _ordered_keys(self, namespace: str | None) -> Iterable[bytes]:
        if namespace is None:
            return self._entries.keys()
        return self._namespace_order.get(namespace, {}).keys()

    def total_bytes(self) -> int:
        return sum(self._namespace_bytes.values())
