"""Storing a call's segments before the caller goes on: in chain order, until one fails.

Owns `SegmentSink` (what takes a call's span records: this, or the background
`SegmentWriter`) and `DirectPuts`, which puts them right away and keeps each stored one
in the worker's local tier. It decides nothing about what a call stores.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvsplice.client.store.local_tier import LocalTier
from kvsplice.client.store.segment_io import SpanRecord, put_meta, span_meta
from kvsplice.client.store.store_client import StoreClient
from kvsplice.common.errors import ResourceExhausted
from kvsplice.common.segment import SegmentMeta

logger = logging.getLogger(__name__)


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
