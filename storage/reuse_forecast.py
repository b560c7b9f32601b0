"""When each evictable segment is likely to be used next, learned online: a session's next
request from the waits every session has shown and how many sessions never came back (their
lease ran out); an unheld segment's next use from its own uses. Eviction takes the furthest
first (Belady's rule on estimates: `sessions`). No I/O, no locks: `SessionLeases` calls it.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from itertools import accumulate

MAX_OUTCOMES = 4096  # the latest waits and expiries the estimate is made from (a window)


class ReuseForecast:
    """Waits between a session's requests (`returned`), sessions that never came back
    (`expired`), both over the latest `max_outcomes`; and each stored segment's uses since its
    first put (`read`, and `stored` again within `max_remembered` evictions of its own)."""

    def __init__(self, max_remembered: int, max_outcomes: int = MAX_OUTCOMES) -> None:
        self._max_remembered = max_remembered  # evicted keys whose uses are kept
        self._max_outcomes = max_outcomes
        self._evicted: OrderedDict[bytes, tuple[float, int]] = OrderedDict()
        self._outcomes: deque[float] = deque()  # waits; math.inf for an expiry
        self._waits: list[float] = []  # sorted
        self._suffix_sums: list[float] | None = None  # of _waits, from each index on
        self._num_expired = 0
        self._uses: dict[bytes, tuple[float, int]] = {}  # key -> (first put at, uses since)

    def returned(self, wait_s: float) -> None:
        self._record(wait_s)
        bisect.insort(self._waits, wait_s)

    def expired(self) -> None:
        self._record(math.inf)
        self._num_expired += 1

    def stored(self, key: bytes, now_s: float) -> None:
        """A put; of a key remembered as evicted, a use since its first put."""
        evicted = self._evicted.pop(key, None)
        self._uses[key] = (now_s, 0) if evicted is None else (evicted[0], evicted[1] + 1)

    def read(self, key: bytes, now_s: float) -> None:
        """A use; of a key stored before this was tracking (a restart), its first."""
        first_s, num_uses = self._uses.get(key, (now_s, -1))
        self._uses[key] = (first_s, num_uses + 1)

    def forget(self, key: bytes) -> None:
        found = self._uses.pop(key, None)
        if found is not None and self._max_remembered:
            self._evicted[key] = found
            if len(self._evicted) > self._max_remembered:
                self._evicted.popitem(last=False)

    def session_wait_s(self, idle_s: float) -> float:
        """Expected time to a session's next request after `idle_s` idle, divided by the
        chance that it comes (inf: none idle this long came back, and some never did).

        NOTE: an expiry counts as never coming back at every idle time, though it waited
        only its lease: a longer lease (a retain hint) is rare, and the error is on the
        side of evicting what has waited longer than any expired session.
        """
        waits = self._waits
        first = bisect.bisect_right(waits, idle_s)
        num_longer = len(waits) - first
        if num_longer == 0:
            # NOTE: no session ever waited this long: with none seen expire either, as long
            # again as it has waited (the elapsed time is the only scale there is)
            return idle_s if self._num_expired == 0 else math.inf
        if self._suffix_sums is None:
            self._suffix_sums = list(accumulate(reversed(waits)))[::-1]
        remaining_s = self._suffix_sums[first] / num_longer - idle_s
        return remaining_s * (num_longer + self._num_expired) / num_longer

    def segment_wait_s(self, key: bytes, now_s: float) -> float:
        """The mean time between an unheld segment's uses so far (since its first put)."""
        stored_at_s, num_uses = self._uses.get(key, (now_s, 0))
        return (now_s - stored_at_s) / max(num_uses, 1)

    def _record(self, outcome: float) -> None:
        self._suffix_sums = None
        self._outcomes.append(outcome)
        if len(self._outcomes) > self._max_outcomes:
            oldest = self._outcomes.popleft()
            if oldest == math.inf:
                self._num_expired -= 1
            else:
                del self._waits[bisect.bisect_left(self._waits, oldest)]
