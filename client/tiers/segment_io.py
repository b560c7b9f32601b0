"""Store ⇄ tensors: fetch-and-verify a segment, build the meta of a span and put it.

Owns the conversions between K/V and what the store holds (payload bytes plus
`SegmentMeta`: fetched K/V stay in stored form until a splice writes them), the off-chain
key of approximate K/V, and the two ways a call's segments get stored (`SegmentSink`):
before the caller goes on (`DirectPuts`, in chain order until one fails, each stored one
kept in the worker's local tier), or off the critical path (`SegmentWriter`: a bounded
queue and one writer thread that encodes and puts them in order while the next call
runs; a batch stops at its first failed put, since the segments after it would hang off a
missing link of the key chain; every segment is counted as stored or failed, a full
queue blocks the submitter rather than dropping work; with a `LocalTier` each segment is
held there as pending from submission, confirmed when acked, dropped when it fails; while
the engine prefills (`paused()`) the thread starts no new put, since encoding competes
with the prefill for the same cores). It decides nothing about reuse or what a call
stores; the store client owns transport and retries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from kvsplice.client.execute.execution import CallTimings, timed
from kvsplice.client.tiers.local_tier import LocalTier
from kvsplice.common.errors import CorruptPayload, KvspliceError, ResourceExhausted
from kvsplice.common.keys import content_key, context_key
from kvsplice.common.segment import MAX_LEFT_TAIL, SegmentKind, SegmentMeta
from kvsplice.kvmath.payload import StoredKV, decode_stored, encode_payload
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.put_queue import PutQueue

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchedSegment:
    """A fetched segment's meta and its verified K/V, still in stored form (views of the
    payload): a splice writes them into its cache in one pass, `kv.decode()` makes tensors."""

    meta: SegmentMeta
    kv: StoredKV


@dataclass(frozen=True)
class SpanRecord:
    """A span's K/V and everything its meta needs, waiting to be put."""

    kv: SegmentKV
    token_ids: tuple[int, ...]
    parent_key: bytes
    left_tail_ids: tuple[int, ...]
    index_text: str = ""
    kind: SegmentKind = "prompt"
    exact: bool = False

    @property
    def context_key(self) -> bytes:
        return context_key(self.parent_key, self.token_ids)


def left_tail(token_ids: Sequence[int], start: int) -> tuple[int, ...]:
    """Up to `MAX_LEFT_TAIL` tokens right before position `start`."""
    return tuple(token_ids[max(0, start - MAX_LEFT_TAIL) : start])


def fetch_segment(
    store: StoreClient, key: str | bytes, *, fingerprint: str, timings: CallTimings
) -> FetchedSegment | None:
    """Get and verify one segment (checksum, fingerprint, agreement with its meta); None on
    a miss or a payload that fails verification. Nothing is decoded here."""
    with timed(timings, "fetch_s"):
        found = store.get_segment(key, model_fingerprint=fingerprint)
    if found is None:
        return None
    meta, payload = found
    with timed(timings, "decode_s"):
        try:
            kv = decode_stored(payload, expect_fingerprint=fingerprint)
        except CorruptPayload as error:  # a corrupt payload is a miss, never a splice
            logger.warning(
                "segment %s failed verification (%s); computing instead", meta.segment_id, error
            )
            return None
    if kv.num_tokens != meta.num_tokens or kv.start_position != meta.start_position:
        logger.warning(
            "segment %s payload disagrees with its meta; computing instead", meta.segment_id
        )
        return None
    return FetchedSegment(meta, kv)


def span_meta(
    namespace: str, record: SpanRecord, *, fingerprint: str, ttl_s: float | None = None
) -> SegmentMeta:
    """The meta `record` is stored under in `namespace` (created now)."""
    kv = record.kv
    return SegmentMeta(
        namespace=namespace,
        model_fingerprint=fingerprint,
        context_key=record.context_key,
        parent_key=record.parent_key,
        content_key=content_key(record.token_ids),
        token_ids=record.token_ids,
        start_position=kv.start_position,
        layer_start=kv.layer_start,
        layer_end=kv.layer_end,
        ttl_s=ttl_s,
        created_at_s=time.time(),
        left_tail_ids=record.left_tail_ids,
        index_text=record.index_text,
        kind=record.kind,
        exact=record.exact,
    )


def put_span(
    store: StoreClient,
    record: SpanRecord,
    *,
    fingerprint: str,
    quant: str,
    ttl_s: float | None = None,
) -> bool:
    """Encode `record.kv` under `quant` and put it; False if the store was unreachable."""
    meta = span_meta(store.namespace, record, fingerprint=fingerprint, ttl_s=ttl_s)
    return put_meta(store, meta, record.kv, quant=quant)


def put_meta(store: StoreClient, meta: SegmentMeta, kv: SegmentKV, *, quant: str) -> bool:
    """Encode `kv` under `quant` and put it under `meta`; False if the store was unreachable."""
    payload = encode_payload(kv, model_fingerprint=meta.model_fingerprint, quant=quant)
    return store.put_segment(meta, payload)


class SegmentSink(Protocol):
    """Takes one call's records in chain order; returns the metas of those it stored or
    queued (`SegmentWriter` queues them for its thread, `DirectPuts` stores them now)."""

    def submit(self, records: Sequence[SpanRecord]) -> list[SegmentMeta]: ...


@dataclass(frozen=True)
class DirectPuts:
    """Puts records before `submit` returns; `local` keeps each one stored (0 bytes: none)."""

    store: StoreClient
    fingerprint: str
    quant: str
    local: LocalTier

    def submit(self, records: Sequence[SpanRecord]) -> list[SegmentMeta]:
        """Put `records` in order until one fails; the metas of those stored."""
        stored: list[SegmentMeta] = []
        for record in records:
            meta = span_meta(self.store.namespace, record, fingerprint=self.fingerprint)
            if not self._put(meta, record):
                logger.info(
                    "%d of %d segments not stored", len(records) - len(stored), len(records)
                )
                break
            stored.append(meta)
        return stored

    def _put(self, meta: SegmentMeta, record: SpanRecord) -> bool:
        """False when the store is unreachable or full (the answer stands)."""
        try:
            stored = put_meta(self.store, meta, record.kv, quant=self.quant)
        except ResourceExhausted as error:  # a full store costs later hits, never this call
            logger.warning("store is full, segment not stored: %s", error)
            return False
        if stored:
            self.local.put(meta, record.kv)
        return stored


# One call's segments, in chain order.
Batch = list[tuple[SegmentMeta, SpanRecord]]


@dataclass
class WriterCounters:
    """Segments by outcome; `num_batches` calls submitted."""

    num_batches: int = 0
    num_stored: int = 0
    num_failed: int = 0


class SegmentWriter:
    """Puts submitted batches in order on one daemon thread. `close()` drains it first."""

    def __init__(
        self,
        store: StoreClient,
        *,
        fingerprint: str,
        quant: str,
        local: LocalTier | None = None,
        max_queued_batches: int = 16,
    ) -> None:
        if max_queued_batches < 1:
            raise ValueError(f"max_queued_batches {max_queued_batches} must be >= 1")
        self._store, self._fingerprint, self._quant, self._local = store, fingerprint, quant, local
        self.counters = WriterCounters()
        self._may_put = threading.Event()
        self._may_put.set()
        self._puts: PutQueue[Batch] = PutQueue(
            self._put_batch, max_queued_batches, name="kvsplice-writer"
        )

    def submit(self, records: Sequence[SpanRecord]) -> list[SegmentMeta]:
        """Queue `records` (one call's, in chain order); returns their metas. Blocks when full."""
        if not self._puts.running:
            raise RuntimeError("the segment writer is closed")
        metas = [
            span_meta(self._store.namespace, r, fingerprint=self._fingerprint) for r in records
        ]
        if self._local is not None:
            for meta, record in zip(metas, records, strict=True):
                self._local.put(meta, record.kv, pending=True)
        if records:
            self.counters.num_batches += 1
            self._puts.put(list(zip(metas, records, strict=True)))
        return metas

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No new put starts inside the `with` (one already sending finishes)."""
        self._may_put.clear()
        try:
            yield
        finally:
            self._may_put.set()

    def flush(self) -> None:
        """Return once every batch submitted so far has been put (or has failed)."""
        self._puts.flush()

    def close(self) -> None:
        """Put what is queued, then stop the thread."""
        self._puts.close()

    def _put_batch(self, batch: Batch) -> None:
        for index, (meta, record) in enumerate(batch):
            self._may_put.wait()
            if self._put(meta, record):
                self.counters.num_stored += 1
                if self._local is not None:
                    self._local.confirm(meta.context_key)
                continue
            failed = batch[index:]
            self.counters.num_failed += len(failed)
            logger.warning("%d of %d segments of a call not stored", len(failed), len(batch))
            if self._local is not None:
                for lost, _ in failed:
                    self._local.invalidate(lost.context_key)
            return

    def _put(self, meta: SegmentMeta, record: SpanRecord) -> bool:
        start_s = time.perf_counter()
        try:
            stored = put_meta(self._store, meta, record.kv, quant=self._quant)
        except KvspliceError as error:  # a full store costs later hits, never a call
            logger.warning("segment %s not stored: %s", meta.segment_id, error)
            return False
        except Exception:  # the thread must outlive any one put; the failure is counted
            logger.exception("segment %s not stored", meta.segment_id)
            return False
        logger.debug("put %s in %.1f ms", meta.segment_id, (time.perf_counter() - start_s) * 1e3)
        return stored
