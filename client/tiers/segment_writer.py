"""Storing a call's segments off the critical path: a bounded queue and one writer thread.

Owns `SegmentWriter`. The engine hands it a call's span records right after the
call (their K/V already read out of the model's cache); the thread encodes and
puts them in order while the next call runs. A batch stops at its first failed
put (the segments after it would hang off a missing link of the key chain).
Nothing is lost silently: every segment is counted as stored or failed, failures
are logged, and a full queue blocks the submitting caller (back-pressure) rather
than dropping work. With a `LocalTier`, each segment is held there as pending
from submission, confirmed when its put is acked and dropped when it fails.
While the engine prefills (`paused()`), the thread starts no new put: encoding
and sending compete for the same cores, and the prefill is the call's TTFT.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvsplice.client.tiers.local_tier import LocalTier
from kvsplice.client.tiers.segment_io import SpanRecord, put_meta, span_meta
from kvsplice.common.errors import KvspliceError
from kvsplice.common.segment import SegmentMeta
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.put_queue import PutQueue

logger = logging.getLogger(__name__)

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
