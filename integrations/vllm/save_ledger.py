"""The scheduler half's save ledger: claims, acknowledgements, expiry, bad segments.

A chunk is put by one request at a time (`claim`) and counts as stored only once a
worker acknowledged it; a failed put, or one unanswered for `IN_FLIGHT_TTL_S`, frees it to
be put again. Segments a worker found corrupt are not promised for `BAD_SEGMENT_TTL_S`.
Knows (namespace, key) pairs and segment ids, not requests, chains or vLLM.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Iterable

from kvsplice.integrations.vllm.lookups import Found
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.storeclient.results import PrefixLookup

# Chunks acknowledged recently (a system prompt shared by many requests is sent once).
MAX_RECENT_KEYS = 65_536
# A save never acknowledged nor failed (a worker gone) stops blocking others after this.
IN_FLIGHT_TTL_S = 120.0
# Segments a worker found corrupt are not promised for this long (deleted meanwhile).
BAD_SEGMENT_TTL_S = 600.0

Key = tuple[str, bytes]  # (namespace, a chunk's context key)


class SaveLedger:
    def __init__(self) -> None:
        self._in_flight: dict[Key, float] = {}  # claimed, not yet acknowledged nor failed
        self._acked: OrderedDict[Key, int] = OrderedDict()  # key -> the round it was acked in
        self.seq = 0  # rounds of acknowledgements so far
        self._bad_segments: dict[str, float] = {}  # segment id -> promised again from then

    def found_stored(self, keys: Collection[Key]) -> int:
        """A lookup found `keys` stored: they count as acknowledged (a request its local hit
        covers is not looked up, and would put them again). The round to `claim` against."""
        if keys:
            self._acknowledged(keys)
        return self.seq

    def claim(self, key: Key, lookup_seq: int) -> bool:
        """Whether a request looked up in round `lookup_seq` should put `key`: nobody is
        putting it now, and it was not acknowledged since that lookup (acknowledged before
        and not found by the lookup: evicted, or past a hole; put again)."""
        if key in self._in_flight or self._acked.get(key, -1) > lookup_seq:
            return False
        self._in_flight[key] = time.monotonic()
        return True

    def acknowledge(self, keys: Collection[Key]) -> None:
        """The sidecar stored `keys`."""
        if keys:
            for key in keys:
                self._in_flight.pop(key, None)
            self._acknowledged(keys)

    def fail(self, keys: Iterable[Key]) -> None:
        """Puts of `keys` failed, were dropped or withheld: free to be put again."""
        for key in keys:
            self._in_flight.pop(key, None)

    def expire(self) -> None:
        """Forget claims older than `IN_FLIGHT_TTL_S` (their worker never answered)."""
        if not self._in_flight:
            return
        oldest = time.monotonic() - IN_FLIGHT_TTL_S
        if next(iter(self._in_flight.values())) < oldest:
            self._in_flight = {k: t for k, t in self._in_flight.items() if t >= oldest}

    def mark_bad(self, segment_id: str) -> None:
        """A worker found `segment_id` corrupt: not promised for `BAD_SEGMENT_TTL_S`."""
        self._bad_segments[segment_id] = time.monotonic() + BAD_SEGMENT_TTL_S

    def without_bad(self, found: Found) -> Found:
        """`found` cut before the first segment (and the first run) a worker found corrupt."""
        if not self._bad_segments:
            return found
        now = time.monotonic()
        self._bad_segments = {s: t for s, t in self._bad_segments.items() if t > now}
        return Found(self._lookup_without_bad(found.exact), self._spans_without_bad(found))

    def _lookup_without_bad(self, lookup: PrefixLookup) -> PrefixLookup:
        for i, ref in enumerate(lookup.segments):
            if ref.segment_id in self._bad_segments:
                kept = lookup.segments[:i]
                return PrefixLookup(kept, kept[-1].end_position if kept else 0)
        return lookup

    def _spans_without_bad(self, found: Found) -> tuple[ReusedSpan, ...]:
        for i, span in enumerate(found.spans):
            if span.segment_id in self._bad_segments:
                return found.spans[:i]
        return found.spans

    def _acknowledged(self, keys: Iterable[Key]) -> None:
        self.seq += 1
        for key in keys:
            self._acked[key] = self.seq
            self._acked.move_to_end(key)
        while len(self._acked) > MAX_RECENT_KEYS:
            self._acked.popitem(last=False)
