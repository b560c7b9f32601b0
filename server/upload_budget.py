"""The global budget of in-flight upload bytes, and how long an upload may stay silent.

Each PutSegment reserves its declared payload size when its header arrives and
returns it when the call ends, however it ends; past the budget a put is refused
with RESOURCE_EXHAUSTED before any payload byte is buffered. Event loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from kvsplice.common.errors import ResourceExhausted
from kvsplice.common.segment import SegmentMeta

logger = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_MAX_INFLIGHT_NBYTES = 256 * MIB
DEFAULT_IDLE_TIMEOUT_S = 10.0


class UploadSlot:
    """One upload's share of the budget (at most one reservation)."""

    def __init__(self, budget: UploadBudget) -> None:
        self._budget = budget
        self.nbytes = 0

    def reserve(self, meta: SegmentMeta) -> SegmentMeta:
        """Reserve `meta.payload_nbytes`; ResourceExhausted if the budget cannot hold them."""
        if self.nbytes:
            raise RuntimeError("an upload slot reserves once")
        self._budget.take(meta.payload_nbytes)
        self.nbytes = meta.payload_nbytes
        return meta


class UploadBudget:
    """At most `max_inflight_nbytes` declared payload bytes across uploads in progress."""

    def __init__(
        self,
        max_inflight_nbytes: int = DEFAULT_MAX_INFLIGHT_NBYTES,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        if max_inflight_nbytes <= 0:
            raise ValueError(f"max_inflight_nbytes must be > 0, got {max_inflight_nbytes}")
        if not idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {idle_timeout_s}")
        self.max_inflight_nbytes = max_inflight_nbytes
        self.idle_timeout_s = idle_timeout_s
        self.inflight_nbytes = 0

    @contextmanager
    def slot(self) -> Iterator[UploadSlot]:
        slot = UploadSlot(self)
        try:
            yield slot
        finally:
            self.inflight_nbytes -= slot.nbytes

    def take(self, nbytes: int) -> None:
        if self.inflight_nbytes + nbytes > self.max_inflight_nbytes:
            raise ResourceExhausted(
                f"uploads in flight hold {self.inflight_nbytes} of {self.max_inflight_nbytes} "
                f"bytes; {nbytes} more do not fit (retry later)"
            )
        self.inflight_nbytes += nbytes
