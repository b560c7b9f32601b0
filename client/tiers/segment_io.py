"""Store ⇄ tensors: fetch-and-verify a segment, build the meta of a span and put it.

Owns the conversions between K/V and what the store holds (payload bytes plus
`SegmentMeta`: fetched K/V stay in stored form until a splice writes them), the off-chain key of approximate K/V, and
storing a call's segments before the caller goes on (`DirectPuts`, in chain order
until one fails, each stored one kept in the worker's local tier; `SegmentSink`: what
takes a call's records, this or the background `SegmentWriter`). It decides nothing
about reuse or what a call stores; the store client owns transport and retries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvsplice.client.execute.execution import CallTimings, timed
from kvsplice.client.tiers.local_tier import LocalTier
from kvsplice.common.errors import CorruptPayload, ResourceExhausted
from kvsplice.common.keys import content_key, context_key
from kvsplice.common.segment import MAX_LEFT_TAIL, SegmentKind, SegmentMeta
from kvsplice.kvmath.payload import StoredKV, decode_stored, encode_payload
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.storeclient.client import StoreClient

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
