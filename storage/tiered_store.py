"""The store the server uses: segments and blobs over stacked tiers, with leases, TTL,
namespace quotas, capacity eviction and removal notifications.

Owns key scoping, the locking discipline and who is told that a segment is gone;
bytes at rest belong to the tiers, bookkeeping to `Catalog`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import reduce
from typing import NamedTuple

import xxhash

from kvsplice.common.errors import CorruptPayload, InvalidRequest, ResourceExhausted
from kvsplice.common.segment import SegmentMeta
from kvsplice.storage.blob_store import BlobStore
from kvsplice.storage.catalog import CatalogEntry, NamespaceUsage
from kvsplice.storage.catalog_loader import load_catalog
from kvsplice.storage.config import StoreConfig
from kvsplice.storage.keyspace import segment_key
from kvsplice.storage.segment_codec import (
    encode_segment,
    meta_digest,
    payload_view,
    segment_payload,
)
from kvsplice.storage.tier import StorageTier, TierStats
from kvsplice.storage.tier_stack import Body, TierStack

logger = logging.getLogger(__name__)

RemovalListener = Callable[[SegmentMeta], None]
# delete: asked for; ttl: expired; quota/capacity: evicted for room;
# lost: the durable tier no longer held it (failed verification, or evicted on its own).
REMOVAL_REASONS = ("delete", "ttl", "quota", "capacity", "lost")
_NUM_STRIPES = 64


@dataclass(frozen=True)
class StoredSegment:
    meta: SegmentMeta
    payload: bytes | memoryview  # exactly meta.payload_nbytes bytes, verified


@dataclass(frozen=True)
class TierUsage:
    """How full one tier is now (`capacity_bytes` None: no fixed bound known)."""

    used_bytes: int
    capacity_bytes: int | None


@dataclass(frozen=True)
class StoreStats:
    tiers: Mapping[str, TierStats]
    total: TierStats
    num_segments: int
    stored_bytes: int  # segment bodies (meta + payload), what quotas count
    removals: Mapping[str, int]  # by REMOVAL_REASONS
    usage: Mapping[str, TierUsage]  # by tier name, fastest first
    durable_tier: str  # the last tier: segments live (and are removed) there


class _Victim(NamedTuple):
    key: bytes
    entry: CatalogEntry
    stripe: threading.RLock


Removed = list[tuple[SegmentMeta, str]]


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
    """

    def __init__(
        self,
        config: StoreConfig,
        tiers: Sequence[StorageTier],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._stack = TierStack(tiers)
        self._clock = clock
        self._lock = threading.Lock()
        self._stripes = tuple(threading.RLock() for _ in range(_NUM_STRIPES))
        self._catalog, num_dropped = load_catalog(self._stack)
        self._listeners: list[RemovalListener] = []
        self._removals: Counter[str] = Counter(lost=num_dropped)
        self._blobs = BlobStore(self._stack, self._stripe, self._write_blob, clock)
        self._closed = False

    # -- segments -------------------------------------------------------------

    def put(self, meta: SegmentMeta, payload: bytes | memoryview) -> None:
        """Store `payload` under (namespace, context_key), replacing any previous record.

        Raises `InvalidRequest` if size or checksum disagree with `meta`;
        `ResourceExhausted` if the namespace quota (after evicting the namespace's
        own unleased LRU segments) or the durable tier (after evicting any
        unleased LRU segments) cannot fit it. Once the durable tier holds the
        record it is stored, even if a cache tier then raises `StoreUnavailable`.
        """
        view = payload_view(meta, payload)
        key = segment_key(meta.namespace, meta.context_key)
        body = encode_segment(meta, view)
        entry = CatalogEntry(meta, len(body), meta_digest(body))
        removed: Removed = []
        try:
            with self._stripe(key):
                self._put_locked(key, body, entry, removed)
        finally:
            self._notify(removed)

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
        tiers = self._stack.tiers
        tier_stats = {tier.name: tier.stats() for tier in tiers}
        usage = {tier.name: TierUsage(tier.used_bytes(), tier.capacity_bytes()) for tier in tiers}
        with self._lock:
            return StoreStats(
                tiers=tier_stats,
                total=reduce(TierStats.__add__, tier_stats.values(), TierStats()),
                num_segments=len(self._catalog),
                stored_bytes=self._catalog.total_bytes(),
                removals={reason: self._removals[reason] for reason in REMOVAL_REASONS},
                usage=usage,
                durable_tier=self._stack.durable.name,
            )

    def add_removal_listener(self, listener: RemovalListener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def forget_evicted(self, key: bytes) -> None:
        """`on_evict` target of a self-evicting durable tier: `key` is gone from it."""
        with self._lock:
            entry = self._catalog.pop(key)
        if entry is not None:
            self._notify([(entry.meta, "capacity")])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stack.close()

    # -- internals: callers hold the key's stripe where the name says `_locked` --

    def _stripe(self, key: bytes) -> threading.RLock:
        return self._stripes[xxhash.xxh3_64_intdigest(key) % _NUM_STRIPES]

    def _write_blob(self, key: bytes, body: bytes) -> None:
        removed: Removed = []
        try:
            self._write_durable(key, body, removed)
        finally:
            self._notify(removed)

    def _put_locked(self, key: bytes, body: bytes, entry: CatalogEntry, removed: Removed) -> None:
        victims = self._reserve_quota(key, entry)
        try:
            self._evict(victims, "quota", removed)
            self._write_durable(key, body, removed)
            with self._lock:
                self._catalog.insert(key, entry)
        finally:
            with self._lock:
                self._catalog.unreserve(entry.meta.namespace, entry.body_nbytes)
        self._stack.fill_caches(key, body)

    def _reserve_quota(self, key: bytes, entry: CatalogEntry) -> list[_Victim]:
        """Reserve the entry's bytes, claiming the namespace's LRU victims that must go first."""
        namespace, nbytes = entry.meta.namespace, entry.body_nbytes
        quota = self._config.quota_for(namespace)
        with self._lock:
            victims: list[_Victim] = []
            if quota is not None:
                old = self._catalog.get(key)
                replaced_nbytes = 0 if old is None else old.body_nbytes
                excess = self._catalog.used_bytes(namespace) - replaced_nbytes + nbytes - quota
                victims = self._claim(namespace, excess, exclude=key) if nbytes <= quota else []
                if nbytes > quota or sum(v.entry.body_nbytes for v in victims) < excess:
                    self._unclaim(victims)
                    raise ResourceExhausted(
                        f"namespace {namespace!r}: {nbytes} bytes do not fit its quota of "
                        f"{quota} bytes (segments being read cannot be evicted)"
                    )
                self._pop_claimed(victims)
            self._catalog.reserve(namespace, nbytes)
        return victims

    def _write_durable(self, key: bytes, body: bytes, removed: Removed) -> None:
        """Put into the durable tier, evicting LRU unleased segments while it is full."""
        durable = self._stack.durable
        capacity = durable.capacity_bytes()
        if capacity is not None and len(body) > capacity:
            raise ResourceExhausted(f"{len(body)} bytes exceed {durable.name}'s {capacity} bytes")
        while True:
            try:
                durable.put(key, body)
                return
            except ResourceExhausted as exc:
                with self._lock:
                    victims = self._claim(None, len(body), exclude=key)
                    self._pop_claimed(victims)
                if not victims:
                    raise ResourceExhausted(
                        f"{durable.name} is full and no unleased segment is left to evict"
                    ) from exc
                self._evict(victims, "capacity", removed)

    def _claim(self, namespace: str | None, nbytes: int, exclude: bytes) -> list[_Victim]:
        """LRU unleased segments worth >= `nbytes` whose stripes were free (caller holds `_lock`).

        Stripes are only tried, never waited for: see the class docstring.
        """
        victims = []
        for key, entry in self._catalog.lru_victims(namespace, nbytes, exclude, self._try_stripe):
            victims.append(_Victim(key, entry, self._stripe(key)))
        return victims

    def _try_stripe(self, key: bytes) -> bool:
        return self._stripe(key).acquire(blocking=False)

    def _pop_claimed(self, victims: list[_Victim]) -> None:
        for victim in victims:
            self._catalog.pop(victim.key)

    def _unclaim(self, victims: list[_Victim]) -> None:
        for victim in victims:
            victim.stripe.release()

    def _evict(self, victims: list[_Victim], reason: str, removed: Removed) -> None:
        """Delete claimed (already uncataloged) victims from every tier."""
        removed.extend((victim.entry.meta, reason) for victim in victims)
        try:
            for victim in victims:
                self._stack.delete(victim.key)
        finally:
            self._unclaim(victims)

    def _read(self, key: bytes, namespace: str, lease: bool) -> StoredSegment | None:
        removed: Removed = []
        try:
            with self._stripe(key):
                segment = self._read_locked(key, removed)
                with self._lock:
                    self._catalog.record_lookup(namespace, hit=segment is not None)
                    if segment is not None:
                        self._catalog.touch(key)
                        if lease:
                            self._catalog.lease(key)
        finally:
            self._notify(removed)
        return segment

    def _read_locked(self, key: bytes, removed: Removed) -> StoredSegment | None:
        entry = self._live_entry(key, removed)
        if entry is None:
            return None
        body = self._stack.get(key, is_current=lambda b: _digest_or_none(b) == entry.meta_digest)
        if body is not None and _digest_or_none(body) != entry.meta_digest:
            logger.warning("durable tier holds a version of %s this store did not write", key.hex())
            return None
        if body is not None:
            try:
                return StoredSegment(entry.meta, segment_payload(body, entry.meta))
            except CorruptPayload as exc:
                logger.warning("segment %s dropped: %s", key.hex(), exc)
        self._remove_locked(key, entry, "lost", removed)
        return None

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
        """Count removals and tell every listener; a listener's error is re-raised after all ran."""
        if not removed:
            return
        with self._lock:
            self._removals.update(reason for _, reason in removed)
            listeners = list(self._listeners)
        errors = []
        for meta, reason in removed:
            logger.debug("segment %s/%s removed (%s)", meta.namespace, meta.segment_id, reason)
            for listener in listeners:
                try:
                    listener(meta)
                except Exception as exc:
                    logger.exception("removal listener failed on %s", meta.segment_id)
                    errors.append(exc)
        if errors:
            raise errors[0]


def _digest_or_none(body: Body) -> int | None:
    try:
        return meta_digest(body)
    except CorruptPayload:
        return None
