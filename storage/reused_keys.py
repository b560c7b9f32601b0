"""Which stored segments were re-used: read again since they were put, or put again soon after
their own eviction (the next request that needed them missed). Eviction ranks re-used segments
without a session after the other unheld ones (`sessions`): a shared document's prefix
outlives the one-shot prompts that would flush it. No I/O, no locks: `SessionLeases` calls it.
"""

from __future__ import annotations

from collections import OrderedDict


class ReusedKeys:
    """Stored keys read again (`read`) or put again (`stored`) within `max_remembered`
    evictions (`forget`) of their own; the keys of those evictions, oldest dropped first."""

    def __init__(self, max_remembered: int) -> None:
        self._max_remembered = max_remembered
        self._reused: set[bytes] = set()
        self._evicted: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self._reused

    def read(self, key: bytes) -> None:
        self._reused.add(key)

    def stored(self, key: bytes) -> None:
        if self._evicted.pop(key, False) is None:
            self._reused.add(key)

    def forget(self, key: bytes) -> None:
        """`key` left the store: remembered as evicted (if any are)."""
        self._reused.discard(key)
        if self._max_remembered:
            self._evicted[key] = None
            self._evicted.move_to_end(key)
            if len(self._evicted) > self._max_remembered:
                self._evicted.popitem(last=False)
