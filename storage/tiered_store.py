"""The store the server uses: segments and blobs over stacked tiers, with leases, TTL,
namespace quotas, capacity eviction and removal notifications.

Owns key scoping, the locking discipline and who is told that a segment is gone;
bytes at rest belong to the tiers, bookkeeping to `Catalog`, making room (quota
reservations, capacity evictions) to `RoomMaker`, reads through to the shared tier
to `SharedReads`, the shape of its statistics to `store_stats`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import xxhash

from kvsplice.common.errors import CorruptPayload, InvalidRequest
from kvsplice.common.segment import SegmentMeta
from kvsplice.storage.blob_store import BlobStore
from kvsplice.storage.catalog import CatalogEntry, NamespaceUsage
from kvsplice.storage.catalog_loader import load_catalog
from kvsplice.storage.config import StoreConfig
from kvsplice.storage.counter_records import CounterRecords
from kvsplice.storage.keyspace import segment_key
from kvsplice.storage.pressure import NamespacePressure, PressureCounters
from kvsplice.storage.record import SealedRecord
from kvsplice.storage.room_maker import RoomMaker
from kvsplice.storage.segment_codec import (
    Payload,
    VerifiedPayload,
    meta_digest,
    sealed_segment,
    segment_payload,
)
from kvsplice.storage.segment_events import SharedEvent
from kvsplice.storage.session_holds import SessionHolds
from kvsplice.storage.shared_catalog import Applied, Removed, SharedCatalog
from kvsplice.storage.shared_reads import UNREACHABLE, SharedReads, digest_or_none
from kvsplice.storage.shared_tier import SharedStatus, SharedTier
from kvsplice.storage.store_listeners import (
    ArrivalListener,
    BlobListener,
    RemovalListener,
    StoreListeners,
)
from kvsplice.storage.store_stats import REMOVAL_REASONS, StoreStats, tier_views
from kvsplice.storage.tier import StorageTier
from kvsplice.storage.tier_stack import TierStack

logger = logging.getLogger(__name__)

# Removals the other sidecars are told about (a local loss or a remote removal is not one).
_SHARED_REASONS = frozenset({"delete", "ttl", "quota", "capacity"})
_NUM_STRIPES = 64


@dataclass(frozen=True)
class StoredSegment:
    meta: SegmentMeta
    payload: bytes | memoryview  # exactly meta.payload_nbytes bytes, verified


class TieredStore:
    """Segments and blobs over `tiers` (fastest first; the last is durable).

    Thread-safe. NOTE on locking: each key maps to one of `_NUM_STRIPES` RLocks,
    held around every tier operation on that key (so tiers never disagree about
    which version a key holds); `_lock` guards the catalog and is held briefly,
    never around I/O. Order: stripe, then `_lock`. Other keys' stripes are only
    ever *tried* (eviction skips a busy key), so no two threads wait on each other.

    Removal listeners run once per segment that stops existing, after the
    store's locks are released, except when a self-evicting durable tier (a
    memory-only store) drops one: then they run inside that put. They must be
    quick and must not call back into the store. Overwriting a key is not a
    removal. A lease defers TTL removal and shields from quota/capacity
    eviction; an explicit `delete` is immediate (readers keep their bytes), and
    so are the budget evictions of a memory tier that is itself durable (it
    cannot see leases; its readers, too, keep their immutable bytes).

    With a `shared` tier (Redis/Valkey, one per deployment) the catalog also holds
    the segments other sidecars put (learned from `apply_shared`); a read the local
    tiers miss falls through to the shared tier and caches what it finds locally.
    Puts, blob writes and removals are published after they are durable locally
    (`SharedTier` says when, and what a degraded tier does to them).
    """

    def __init__(
        self,
        config: StoreConfig,
        tiers: Sequence[StorageTier],
        clock: Callable[[], float] = time.time,
        shared: SharedTier | None = None,
    ) -> None:
        self._stack = TierStack(tiers)
        self._cache_puts = config.cache_puts
        self._shared = shared
        self._clock = clock
        self._lock = threading.Lock()
        self._stripes = tuple(threading.RLock() for _ in range(_NUM_STRIPES))
        self._catalog, num_dropped = load_catalog(self._stack)
        self._shared_catalog = SharedCatalog(self._catalog, self._lock, self._stack)
        self._listeners = StoreListeners()
        self.sessions = SessionHolds(config, self._catalog, self._lock, clock)
        self._removals: Counter[str] = Counter(lost=num_dropped)
        self._pressure = PressureCounters()
        room_shared = None if shared is None else (self._shared_catalog, shared)
        self._room = RoomMaker(
            config,
            self._catalog,
            self._lock,
            self._stripe,
            self._stack,
            self._pressure,
            room_shared,
        )
        self._shared_reads = (
            None
            if shared is None
            else SharedReads(shared, self._shared_catalog, self._stack, self._room, self._expired)
        )
        self._blobs = BlobStore(self._stack, self._stripe, self._write_blob, clock, shared)
        # The sidecar's own counters, in the durable tier beside the segments (never shared).
        self.counters = CounterRecords(self._stack.durable, self._write_blob)
        self._closed = False
        if shared is not None:
            shared.bind(self._stack.peek)

    # -- segments -------------------------------------------------------------

    def put(self, meta: SegmentMeta, payload: Payload) -> None:
        """Store `payload` under (namespace, context_key), replacing any previous record.

        Raises `InvalidRequest` if size or checksum disagree with `meta` (a
        `VerifiedPayload`'s size only: its receiver hashed it, the record carries that);
        `ResourceExhausted` if the namespace quota (after evicting the namespace's
        own unleased LRU segments) or the durable tier (after evicting any
        unleased LRU segments) cannot fit it. Once the durable tier holds the
        record it is stored, even if a cache tier then raises `StoreUnavailable`.
        """
        key, body, entry = _record_of(meta, payload)
        removed: Removed = []
        try:
            with self._stripe(key):
                self._put_locked(key, body, entry, removed)
        finally:
            self._notify(removed)
        if self._shared is not None:
            self._shared.publish_put(key)

    def put_if_absent(self, meta: SegmentMeta, payload: Payload) -> SegmentMeta | None:
        """`put`, unless the key holds a live segment: then nothing is written and its meta
        is returned (the check and the write happen under the key's lock)."""
        key, body, entry = _record_of(meta, payload)
        removed: Removed = []
        try:
            with self._stripe(key):
                existing = self._live_entry(key, removed)
                if existing is not None:
                    return existing.meta
                self._put_locked(key, body, entry, removed)
        finally:
            self._notify(removed)
        if self._shared is not None:
            self._shared.publish_put(key)
        return None

    def get(self, namespace: str, context_key: bytes) -> StoredSegment | None:
        key = segment_key(namespace, context_key)
        return self._read(key, namespace, lease=False)

    @contextmanager
    def reading(self, namespace: str, context_key: bytes) -> Iterator[StoredSegment | None]:
        """`get` under a lease: no eviction removes the segment until the block exits."""
        key = segment_key(namespace, context_key)
        segment = self._read(key, namespace, lease=True)
        try:
            yield segment
        finally:
            if segment is not None:
                self._release(key)

    def get_meta(self, namespace: str, context_key: bytes) -> SegmentMeta | None:
        key = segment_key(namespace, context_key)
        removed: Removed = []
        try:
            with self._stripe(key):
                entry = self._live_entry(key, removed)
        finally:
            self._notify(removed)
        return None if entry is None else entry.meta

    def touch(self, namespace: str, context_key: bytes) -> None:
        """Count a use the store did not serve (a lookup listed it; the worker reads it in
        place or from its own tier): recency moves, as for a `get`. A key not held is ignored."""
        key = segment_key(namespace, context_key)
        with self._lock:
            if self._catalog.get(key) is not None:
                self._catalog.touch(key)

    def delete(self, namespace: str, context_key: bytes) -> bool:
        key = segment_key(namespace, context_key)
        removed: Removed = []
        try:
            with self._stripe(key):
                with self._lock:
                    entry = self._catalog.pop(key)
                if entry is not None:
                    removed.append((entry.meta, "delete"))
                held = self._stack.delete(key)
        finally:
            self._notify(removed)
        return entry is not None or held

    def sweep_expired(self) -> int:
        """Remove expired segments now (leased ones when their lease ends); how many went."""
        with self._lock:
            due = self._catalog.due_keys(self._clock())
        removed: Removed = []
        try:
            for key in due:
                with self._stripe(key):
                    self._live_entry(key, removed)
        finally:
            self._notify(removed)
        return len(removed)

    # -- blobs: a key space of their own (see `BlobStore`) -----------------------

    def put_blob(self, namespace: str, name: str, data: bytes, ttl_s: float | None = None) -> None:
        self._blobs.put(namespace, name, data, ttl_s)

    def get_blob(self, namespace: str, name: str) -> bytes | None:
        return self._blobs.get(namespace, name)

    def delete_blob(self, namespace: str, name: str) -> bool:
        return self._blobs.delete(namespace, name)

    def iter_blob_names(self, namespace: str, prefix: str = "") -> Iterator[str]:
        return self._blobs.iter_names(namespace, prefix)

    # -- views ------------------------------------------------------------------

    def iter_meta(self) -> Iterator[SegmentMeta]:
        """Every segment's meta, all namespaces (the catalog mirrors the durable tier)."""
        with self._lock:
            metas = self._catalog.metas()
        return iter(metas)

    def list_segments(self, namespace: str, offset: int, limit: int) -> list[SegmentMeta]:
        """A page of `namespace`'s segments, oldest first (stable across calls)."""
        if offset < 0 or limit < 0:
            raise InvalidRequest(f"offset {offset} and limit {limit} must be >= 0")
        with self._lock:
            metas = self._catalog.metas(namespace)
        metas.sort(key=lambda meta: (meta.created_at_s, meta.context_key))
        return metas[offset : offset + limit]

    def namespace_usage(self) -> dict[str, NamespaceUsage]:
        with self._lock:
            return self._catalog.usage()

    def stats(self) -> StoreStats:
        tiers: list[StorageTier | SharedTier] = list(self._stack.tiers)
        if self._shared is not None:
            tiers.append(self._shared)
        views = tier_views(tiers)
        with self._lock:
            return StoreStats(
                tiers=views.stats,
                total=views.total,
                num_segments=len(self._catalog),
                stored_bytes=self._catalog.total_bytes(),
                removals={reason: self._removals[reason] for reason in REMOVAL_REASONS},
                usage=views.usage,
                durable_tier=self._stack.durable.name,
                shared=None if self._shared is None else self._shared.status(),
            )

    def namespace_pressure(self) -> dict[str, NamespacePressure]:
        """Per namespace: segments removed by reason and puts refused for room, since start."""
        with self._lock:
            return self._pressure.snapshot()

    def add_removal_listener(self, listener: RemovalListener) -> None:
        self._listeners.add_removal(listener)

    def add_arrival_listener(self, listener: ArrivalListener) -> None:
        """`listener(meta)` runs for each segment another sidecar put (see `apply_shared`)."""
        self._listeners.add_arrival(listener)

    def add_blob_listener(self, listener: BlobListener) -> None:
        """`listener(namespace, name)` runs for each blob another sidecar wrote or removed."""
        self._listeners.add_blob(listener)

    # -- the shared tier ----------------------------------------------------------

    @property
    def shared(self) -> SharedTier | None:
        return self._shared

    def shared_status(self) -> SharedStatus | None:
        return None if self._shared is None else self._shared.status()

    def apply_shared(self, events: Sequence[SharedEvent]) -> None:
        """Bring the catalog in step with other sidecars' `events` (in stream order).

        A put catalogs the segment as held by the shared tier only (its local copies,
        if any, are dropped as stale unless they are that very version); a removal
        uncatalogs it and drops local copies; a blob event drops local copies, so the
        next read fetches the shared version. Listeners run after, outside the locks.
        """
        applied = Applied()
        try:
            for event in events:
                with self._stripe(event.key):
                    self._shared_catalog.apply_locked(event, applied)
        finally:
            self._notify(applied.removed)
            self._listeners.arrived(applied.arrived, applied.blobs)

    def forget_evicted(self, key: bytes) -> None:
        """`on_evict` target of a self-evicting durable tier: `key` is gone from it
        (with a shared tier, only from here: it stays cataloged, read from the cluster)."""
        with self._lock:
            if self._shared is not None:
                if self._catalog.get(key) is not None:
                    self._shared_catalog.mark_remote([key])
                return
            entry = self._catalog.pop(key)
        if entry is not None:
            self._notify([(entry.meta, "capacity")])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._shared is not None:
            self._shared.close()
        self._stack.close()

    # -- internals: callers hold the key's stripe where the name says `_locked` --

    def _stripe(self, key: bytes) -> threading.RLock:
        return self._stripes[xxhash.xxh3_64_intdigest(key) % _NUM_STRIPES]

    def _write_blob(self, key: bytes, body: bytes) -> None:
        removed: Removed = []
        try:
            self._room.write_durable(key, body, removed)
        finally:
            self._notify(removed)

    def _put_locked(
        self, key: bytes, body: SealedRecord, entry: CatalogEntry, removed: Removed
    ) -> None:
        victims = self._room.reserve_quota(key, entry)
        try:
            self._room.evict(victims, "quota", removed)
            self._room.write_durable(key, body, removed, entry.meta.namespace)
            with self._lock:
                self._catalog.insert(key, entry)
        finally:
            with self._lock:
                self._catalog.unreserve(entry.meta.namespace, entry.body_nbytes)
        if self._cache_puts:
            self._stack.fill_caches(key, body)
        else:
            self._stack.drop_cached(key)  # an older version must not outlive this one

    def _read(self, key: bytes, namespace: str, lease: bool) -> StoredSegment | None:
        removed: Removed = []
        arrived: list[SegmentMeta] = []
        try:
            with self._stripe(key):
                segment = self._read_locked(key, removed, arrived)
                with self._lock:
                    self._catalog.record_lookup(namespace, hit=segment is not None)
                    if segment is not None:
                        self._catalog.touch(key)
                        if lease:
                            self._catalog.lease(key)
        finally:
            self._notify(removed)
            self._listeners.arrived(arrived, [])
        return segment

    def _read_locked(
        self, key: bytes, removed: Removed, arrived: list[SegmentMeta]
    ) -> StoredSegment | None:
        entry = self._live_entry(key, removed)
        if entry is None:
            return self._read_through(key, removed, arrived)
        digest, meta = entry.meta_digest, entry.meta
        body = self._stack.get(
            key,
            is_current=lambda b: digest_or_none(b) == digest,
            as_value=lambda b: sealed_segment(meta, VerifiedPayload(segment_payload(b, meta)))[0],
        )
        if body is None and self._shared_reads is not None:
            fetched = self._shared_reads.fetch(key, entry, removed)
            if fetched is UNREACHABLE:
                return None  # a miss for now, not a loss: the segment stays cataloged
            body = fetched
            with self._lock:  # the fetch may have adopted another version of the key
                entry = self._catalog.get(key) or entry
        if body is not None and digest_or_none(body) != entry.meta_digest:
            logger.warning("durable tier holds a version of %s this store did not write", key.hex())
            return None
        if body is not None:
            try:
                return StoredSegment(entry.meta, segment_payload(body, entry.meta))
            except CorruptPayload as exc:
                logger.warning("segment %s dropped: %s", key.hex(), exc)
        self._remove_locked(key, entry, "lost", removed)
        return None

    def _read_through(
        self, key: bytes, removed: Removed, arrived: list[SegmentMeta]
    ) -> StoredSegment | None:
        """A key the catalog does not know, read through to the shared tier (if any)."""
        reads = self._shared_reads
        found = None if reads is None else reads.read_through(key, removed)
        if found is None:
            return None
        entry, body = found
        arrived.append(entry.meta)
        return StoredSegment(entry.meta, segment_payload(body, entry.meta))

    def _live_entry(self, key: bytes, removed: Removed) -> CatalogEntry | None:
        """The key's entry unless expired; an expired one is removed (or doomed if leased)."""
        with self._lock:
            entry = self._catalog.get(key)
            if entry is None or not self._expired(entry):
                return entry
            if self._catalog.is_leased(key):
                self._catalog.doom(key)
                return None
        self._remove_locked(key, entry, "ttl", removed)
        return None

    def _remove_locked(
        self, key: bytes, entry: CatalogEntry, reason: str, removed: Removed
    ) -> None:
        with self._lock:
            if self._catalog.get(key) is not entry:
                return  # removed or replaced meanwhile by someone else
            self._catalog.pop(key)
        removed.append((entry.meta, reason))
        self._stack.delete(key)

    def _release(self, key: bytes) -> None:
        with self._lock:
            if not self._catalog.release(key):
                return
        removed: Removed = []
        try:
            with self._stripe(key):
                with self._lock:
                    entry = self._catalog.get(key)
                    doomed = self._catalog.is_doomed(key) and not self._catalog.is_leased(key)
                if doomed and entry is not None:
                    self._remove_locked(key, entry, "ttl", removed)
        finally:
            self._notify(removed)

    def _expired(self, entry: CatalogEntry) -> bool:
        expires_at_s = entry.expires_at_s
        return expires_at_s is not None and expires_at_s < self._clock()

    def _notify(self, removed: Removed) -> None:
        """Count removals, publish the shared ones, tell every listener (errors re-raised)."""
        if not removed:
            return
        with self._lock:
            self._removals.update(reason for _, reason in removed)
            self.sessions.forget_locked(meta for meta, _ in removed)
            self._pressure.removed((meta.namespace, reason) for meta, reason in removed)
        for meta, reason in removed:
            if self._shared is not None and reason in _SHARED_REASONS:
                self._shared.publish_removal(segment_key(meta.namespace, meta.context_key), reason)
            logger.debug("segment %s/%s removed (%s)", meta.namespace, meta.segment_id, reason)
        self._listeners.removed([meta for meta, _ in removed])


def _record_of(meta: SegmentMeta, payload: Payload) -> tuple[bytes, SealedRecord, CatalogEntry]:
    """The tier key, the sealed record and the catalog entry of a segment to store."""
    record, head = sealed_segment(meta, payload)
    key = segment_key(meta.namespace, meta.context_key)
    return key, record, CatalogEntry(meta, len(record), meta_digest(head))
