"""The store's domain layer: validate, store, index, look up, count. No gRPC here.

Applies the request rules (`request_checks`), keeps keys immutable and the indexes in
step with the store. Event loop only, like the indexes, except
`write` and `get` (store I/O, thread-safe): removals seen on other threads are handed
to the loop before the indexes hear of them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvsplice.common.errors import (
    AlreadyExists,
    CorruptPayload,
    FingerprintMismatch,
    InvalidRequest,
)
from kvsplice.common.keys import KEY_NBYTES
from kvsplice.common.namespace_stats import NamespaceStats
from kvsplice.common.payload_buffer import PayloadBuffer
from kvsplice.common.reuse_report import ReuseReport, Served
from kvsplice.common.segment import SegmentMeta
from kvsplice.index.exact_index import ExactIndex, PrefixMatch
from kvsplice.index.similarity_index import SimilarityIndex, SimilarMatch
from kvsplice.server.admin_models import SegmentHits, SegmentSummary
from kvsplice.server.config import SegmentServiceConfig
from kvsplice.server.reported_reuse import ReportedReuse
from kvsplice.server.request_checks import (
    check_fingerprint,
    check_header,
    check_key,
    check_namespace,
    check_token_ids,
)
from kvsplice.server.session_service import SessionService
from kvsplice.server.shared_prefix import MAX_PROBE_LENGTHS, SharedProbe, extend_from_shared
from kvsplice.storage.catalog import NamespaceUsage
from kvsplice.storage.pressure import NamespacePressure
from kvsplice.storage.segment_codec import VerifiedPayload, payload_digest
from kvsplice.storage.tiered_store import StoredSegment, TieredStore

logger = logging.getLogger(__name__)

_NO_USAGE = NamespaceUsage(segments=0, bytes=0, hits=0, misses=0)
# What makes two puts of one key the same segment (created_at_s and ttl_s may differ).
_IDENTITY_FIELDS = (
    "model_fingerprint", "parent_key", "content_key", "token_ids", "start_position",
    "layer_start", "layer_end", "boundary_layers", "payload_nbytes", "checksum",
)  # fmt: skip


@dataclass(frozen=True)
class SimilarQuery:
    """A FindSimilar request; `limit` 0 means the configured default."""

    namespace: str
    model_fingerprint: str
    token_ids: tuple[int, ...]
    text: str = ""
    left_context_ids: tuple[int, ...] = ()
    parent_key: bytes | None = None
    limit: int = 0


def _flat(payload: bytes | memoryview) -> memoryview:
    view = memoryview(payload)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class IndexWatcher(Protocol):
    """Told what the indexes gain and lose (quick, thread-safe, never calls back)."""

    def indexed(self, meta: SegmentMeta) -> None: ...

    def unindexed(self, namespace: str, context_key: bytes) -> None: ...


class SegmentService:
    """Segments: put/get/delete, prefix lookup, similarity search, per-namespace stats."""

    def __init__(
        self,
        store: TieredStore,
        exact: ExactIndex,
        similar: SimilarityIndex,
        config: SegmentServiceConfig,
    ) -> None:
        self._store = store
        self.sessions = SessionService(store)
        self._exact = exact
        self._similar = similar
        self.config = config
        self._hits: defaultdict[str, int] = defaultdict(int)
        self._misses: defaultdict[str, int] = defaultdict(int)
        # What workers reported (token totals, kept with the tiers; their segment reads go
        # to _segment_hits and _reported_reads).
        self.reported = ReportedReuse(store.counters)
        # Reads served per stored segment (the dashboard's top list); a removed segment's
        # count goes with it, so this never outgrows the store.
        self._segment_hits: Counter[tuple[str, bytes]] = Counter()
        # Reads of stored segments workers served themselves, by where, since start.
        self._reported_reads: Counter[Served] = Counter()
        self._ready = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._watchers: list[IndexWatcher] = []
        store.add_removal_listener(self._on_removed)
        store.add_arrival_listener(self._on_arrived)  # another sidecar's put (shared tier)

    # -- lifecycle --------------------------------------------------------------------

    def rebuild_indexes(self) -> int:
        """Index every stored segment and restore the reported totals the tiers kept
        (called once at start, on the serving loop)."""
        try:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
        except RuntimeError:  # no loop: every call comes from this thread
            self._loop = None
        num_indexed = 0
        for meta in self._store.iter_meta():
            self._index(meta)
            num_indexed += 1
        self.reported.load()
        self._ready = True
        logger.info("indexes rebuilt from the store: %d segments", num_indexed)
        return num_indexed

    def is_ready(self) -> bool:
        return self._ready

    def mark_draining(self) -> None:
        """Report not-ready from now on (shutdown has begun)."""
        self._ready = False

    # -- segments ---------------------------------------------------------------------

    def check_header(self, meta: SegmentMeta) -> SegmentMeta:
        """Validate a put's header before its payload arrives; returns it as it will be stored."""
        return check_header(meta, self.config)

    def put(self, meta: SegmentMeta, payload: bytes) -> SegmentMeta:
        """`write` then `index`: on the event loop, for callers without a thread to spare."""
        stored = self.write(meta, payload)
        self.index(stored)
        return stored

    def write(self, meta: SegmentMeta, payload: bytes | memoryview | PayloadBuffer) -> SegmentMeta:
        """Verify `payload` against `meta` and store it (thread-safe); returns the stored meta.

        Keys are immutable: a key that holds another segment raises AlreadyExists; the
        same segment again is a no-op returning the stored meta. Index it with `index`.
        A streamed payload is hashed here, once: the store carries this checksum to the
        record; a staged one is not (see below).
        """
        meta = self.check_header(meta)
        received = payload if isinstance(payload, PayloadBuffer) else PayloadBuffer(_flat(payload))
        if len(received) != meta.payload_nbytes:
            raise CorruptPayload(
                f"received {len(received)} payload bytes, header says {meta.payload_nbytes}"
            )
        # NOTE: a staged payload is not hashed here: it never crossed a network, its client
        # hashed it, and the durable tier may adopt its file without reading a byte. Every
        # load verifies it (a payload that fails is a counted corrupt miss, then removed):
        # a bad or changed staged file costs a recompute, never a wrong token.
        if received.staged is None and payload_digest(received.view) != meta.checksum:
            raise CorruptPayload(f"payload checksum mismatch for segment {meta.segment_id}")
        verified = VerifiedPayload(received.buffer, received.offset, received.staged)
        existing = self._store.put_if_absent(meta, verified)
        if existing is None:
            return meta
        if any(getattr(existing, f) != getattr(meta, f) for f in _IDENTITY_FIELDS):
            raise AlreadyExists(
                f"segment {meta.segment_id} in {meta.namespace!r} already holds other bytes "
                "or another model's; keys are immutable"
            )
        return existing

    def index(self, meta: SegmentMeta) -> None:
        """Make a written segment findable (readers never see an indexed segment the store
        lacks: write first). Event loop only."""
        self._index(meta)

    def get(self, namespace: str, key: bytes, model_fingerprint: str = "") -> StoredSegment | None:
        """`fetch`, counted as a read of the segment (event loop only)."""
        stored = self.fetch(namespace, key, model_fingerprint)
        self.count_read(stored)
        return stored

    def fetch(
        self, namespace: str, key: bytes, model_fingerprint: str = ""
    ) -> StoredSegment | None:
        """The stored segment or None; FingerprintMismatch if it belongs to another model.

        Thread-safe (store I/O only): a reader counts it with `count_read` on the loop.
        """
        check_namespace(namespace)
        check_key("context_key", key)
        if model_fingerprint:
            check_fingerprint(model_fingerprint)
        stored = self._store.get(namespace, key)  # the store counts this hit or miss
        if (
            stored is not None
            and model_fingerprint
            and stored.meta.model_fingerprint != model_fingerprint
        ):
            raise FingerprintMismatch(
                f"segment {key.hex()} belongs to {stored.meta.model_fingerprint}, not {model_fingerprint}"
            )
        return stored

    def stored_nbytes(self, namespace: str, key: bytes) -> int | None:
        """The payload size stored under `key` (0 if malformed or held nowhere): what a read
        moves; None if unknown here but a shared tier may hold it (a read-through)."""
        if len(key) != KEY_NBYTES:
            return 0
        meta = self._store.get_meta(namespace, key)
        if meta is None:
            return None if self._store.shared is not None else 0
        return meta.payload_nbytes

    def count_read(self, stored: StoredSegment | None) -> None:
        """Count one read of a fetched segment (the dashboard's most-read list). Loop only."""
        if stored is not None:
            self._segment_hits[stored.meta.namespace, stored.meta.context_key] += 1

    def record_reuse(self, namespace: str, report: ReuseReport) -> int:
        """Add a worker's reuse report to `namespace`; returns how many of its segment reads
        were counted (those of segments the namespace still holds). Event loop only."""
        check_namespace(namespace)
        self.reported.add(namespace, report)
        num_counted = 0
        for (key, served), num_reads in report.segment_reads.items():
            if self._store.get_meta(namespace, key) is not None:
                self._segment_hits[namespace, key] += num_reads
                self._reported_reads[served] += num_reads
                num_counted += num_reads
        return num_counted

    def reported_reads(self, served: Served) -> int:
        """Reads of stored segments that workers reported served `served` ("local" or
        "in_place": reads the sidecar never sees) since start."""
        return self._reported_reads[served]

    def delete(self, namespace: str, key: bytes) -> bool:
        check_namespace(namespace)
        deleted = self._store.delete(namespace, check_key("context_key", key))
        self._unindex(namespace, key)  # idempotent; the removal listener may have done it
        return deleted

    def lookup_prefix(
        self, namespace: str, fingerprint: str, token_ids: Sequence[int]
    ) -> PrefixMatch:
        """The longest run of stored segments covering `token_ids` from position 0, the
        shared tier's included (blocking I/O where the local index stops short)."""
        probe = self.lookup_local(namespace, fingerprint, token_ids)
        return self.counted(namespace, self.extend_shared(probe))

    def lookup_local(
        self, namespace: str, fingerprint: str, token_ids: Sequence[int]
    ) -> SharedProbe:
        """The longest run the local index holds (loop only), with what a shared tier may
        carry further: if `extendable`, `extend_from_shared` (off the loop). Count the
        final match with `counted`."""
        check_namespace(namespace)
        check_fingerprint(fingerprint)
        tokens = check_token_ids("token_ids", token_ids, self.config.max_query_tokens)
        match = self._exact.lookup_prefix(namespace, fingerprint, tokens)
        match = self._stored_prefix(namespace, match)
        shared = self._store.shared
        short = match.num_matched_tokens < len(tokens)
        if not short or shared is None or shared.status().degraded:
            return SharedProbe(namespace, fingerprint, tokens, match, extendable=False)
        lengths = self._exact.segment_lengths(namespace, MAX_PROBE_LENGTHS)
        return SharedProbe(namespace, fingerprint, tokens, match, True, lengths)

    def extend_shared(self, probe: SharedProbe) -> PrefixMatch:
        """`probe.match` carried into the shared tier if `extendable` (thread-safe: store
        I/O only; what it reads through is indexed on the loop)."""
        return extend_from_shared(self._store, probe) if probe.extendable else probe.match

    def counted(self, namespace: str, match: PrefixMatch) -> PrefixMatch:
        """`match`, counted as the namespace's hit or miss (loop only)."""
        self._count(namespace, match.num_matched_tokens > 0)
        return match

    def find_similar(self, query: SimilarQuery) -> list[SimilarMatch]:
        """Verified similar segments, best first, at most `query.limit` (or the default)."""
        namespace = check_namespace(query.namespace)
        check_fingerprint(query.model_fingerprint)
        limits = self.config
        tokens = check_token_ids("token_ids", query.token_ids, limits.max_query_tokens)
        left = check_token_ids("left_context_ids", query.left_context_ids, limits.max_query_tokens)
        if len(query.text) > limits.max_index_text_chars:
            raise InvalidRequest(
                f"text holds {len(query.text)} chars > {limits.max_index_text_chars}"
            )
        if not 0 <= query.limit <= limits.max_similar_limit:
            raise InvalidRequest(f"limit {query.limit} not in [0, {limits.max_similar_limit}]")
        parent = check_key("parent_key", query.parent_key) if query.parent_key else None
        matches = self._similar.find_similar(
            namespace,
            query.model_fingerprint,
            tokens,
            text=query.text,
            left_context_ids=left,
            parent_key=parent,
            limit=query.limit or limits.default_similar_limit,
        )
        matches = [m for m in matches if self._still_stored(m.meta)]
        self._count(namespace, bool(matches))
        return matches

    # -- stats (also the admin API's `AdminSource`) ------------------------------------

    def namespace_stats(self, namespace: str | None) -> dict[str, NamespaceStats]:
        """Stats of `namespace` (zeros if unknown), or of every namespace `known_namespaces`."""
        usage = self._store.namespace_usage()
        pressure = self._store.namespace_pressure()
        names = (
            [check_namespace(namespace)]
            if namespace is not None
            else sorted(
                set(usage)
                | set(self._hits)
                | set(self._misses)
                | set(pressure)
                | self.reported.namespaces()
            )
        )
        return {name: self._stats_of(name, usage, pressure.get(name)) for name in names}

    def known_namespaces(self) -> set[str]:
        """Namespaces the store holds, or that were looked up or removed from since start."""
        return set(self.namespace_stats(None))

    def list_segments(self, namespace: str, offset: int, limit: int) -> list[SegmentSummary]:
        check_namespace(namespace)
        metas = self._store.list_segments(namespace, offset, limit)
        return [SegmentSummary.from_meta(meta) for meta in metas]

    def top_segments(self, limit: int) -> list[SegmentHits]:
        """The `limit` stored segments read most often, most first."""
        top = []
        for (namespace, key), num_hits in self._segment_hits.most_common(limit):
            meta = self._store.get_meta(namespace, key)
            if meta is not None:
                top.append(SegmentHits(
                    namespace, meta.segment_id, meta.num_tokens, meta.payload_nbytes, num_hits
                ))  # fmt: skip
        return top

    # -- internals --------------------------------------------------------------------

    def _stats_of(
        self,
        namespace: str,
        usage: dict[str, NamespaceUsage],
        pressure: NamespacePressure | None,
    ) -> NamespaceStats:
        # The store counts segment reads and capacity pressure; the service, index lookups
        # and what workers reported.
        ns_usage = usage.get(namespace, _NO_USAGE)
        pressure = pressure or NamespacePressure()
        reported = self.reported.of(namespace)
        return NamespaceStats(
            num_segments=ns_usage.segments,
            num_bytes=ns_usage.bytes,
            num_hits=ns_usage.hits + self._hits.get(namespace, 0),
            num_misses=ns_usage.misses + self._misses.get(namespace, 0),
            num_evictions=sum(pressure.removals.values()),
            num_refused_puts=sum(pressure.refusals.values()),
            num_calls=reported.num_calls,
            num_prompt_tokens=reported.num_prompt_tokens,
            num_approximate_hit_tokens=reported.num_approximate_hit_tokens,
            hit_tokens=reported.hit_tokens,
        )

    def _count(self, namespace: str, hit: bool) -> None:
        (self._hits if hit else self._misses)[namespace] += 1

    def add_index_watcher(self, watcher: IndexWatcher) -> None:
        """`watcher` hears of every segment indexed and unindexed from now on (on the loop)."""
        self._watchers.append(watcher)

    def _index(self, meta: SegmentMeta) -> None:
        self._exact.add(meta)
        self._similar.add(meta)
        for watcher in self._watchers:
            watcher.indexed(meta)

    def _unindex(self, namespace: str, key: bytes) -> None:
        self._exact.remove(namespace, key)
        self._similar.remove(namespace, key)
        for watcher in self._watchers:
            watcher.unindexed(namespace, key)

    def _on_arrived(self, meta: SegmentMeta) -> None:
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            self._index(meta)
            return
        # NOTE: a read through to the shared tier on a worker thread: indexed on the loop,
        # unless the segment went meanwhile.
        loop.call_soon_threadsafe(self._index_if_stored, meta)

    def _index_if_stored(self, meta: SegmentMeta) -> None:
        if self._store.get_meta(meta.namespace, meta.context_key) is not None:
            self._index(meta)

    def _on_removed(self, meta: SegmentMeta) -> None:
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            self._forget(meta.namespace, meta.context_key)
            return
        # NOTE: on a worker thread (a put evicting, a read dropping an expired segment):
        # the loop forgets it later, unless the key was stored again meanwhile.
        loop.call_soon_threadsafe(self._forget_if_gone, meta.namespace, meta.context_key)

    def _forget(self, namespace: str, key: bytes) -> None:
        self._unindex(namespace, key)
        self._segment_hits.pop((namespace, key), None)

    def _forget_if_gone(self, namespace: str, key: bytes) -> None:
        if self._store.get_meta(namespace, key) is None:
            self._forget(namespace, key)

    def _still_stored(self, meta: SegmentMeta) -> bool:
        """Defensive: an index entry whose segment the store lost is dropped, not served."""
        if self._store.get_meta(meta.namespace, meta.context_key) is not None:
            return True
        logger.warning("index held segment %s that the store lacks; unindexed", meta.segment_id)
        self._unindex(meta.namespace, meta.context_key)
        return False

    def _stored_prefix(self, namespace: str, match: PrefixMatch) -> PrefixMatch:
        """`match` cut at its first segment the store no longer holds.

        NOTE: each segment listed counts as used (eviction recency): a worker reads a listed
        segment in place (same host) or from its own tier, never through `get`, so without
        this the store's LRU would evict the hottest chains first.
        """
        kept: list[SegmentMeta] = []
        for meta in match.segments:
            if not self._still_stored(meta):
                break
            self._store.touch(meta.namespace, meta.context_key)
            kept.append(meta)
        if len(kept) == len(match.segments):
            return match
        return PrefixMatch(tuple(kept), kept[-1].end_position if kept else 0)


def similar_hit_tokens(matches: Sequence[SimilarMatch], num_queried: int) -> int:
    """Tokens a similarity search served: the longest match whose tokens are the query's own.

    A merely similar segment is a candidate for approximate reuse, not a token hit.
    """
    num_exact = max((m.meta.num_tokens for m in matches if m.exact_tokens), default=0)
    return min(num_exact, num_queried)
