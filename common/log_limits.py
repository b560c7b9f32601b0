"""The one rate-limited log: each kind of fault said at most once per interval, every one counted.

A hostile caller or a dead sidecar can provoke a fault per request; this keeps the log's
growth bounded by the number of kinds, not of requests. The sidecar's refusals, the store
client's misses and the vLLM connector's faults all go through it, each in its own words.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import NamedTuple


class Due(NamedTuple):
    """A line is due: the kind's `total` so far, `held_back` of them since its last line."""

    total: int
    held_back: int


class RateLimitedLog:
    """`log(kind, level, msg, *args)`: at `level` once per `interval_s` per kind, else DEBUG.

    `due(kind)` counts one of `kind` and says whether a line about it is due, for callers
    that word their lines themselves; `counts` holds every kind's count. Thread-safe.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self.counts: Counter[Hashable] = Counter()
        self._last_s: dict[Hashable, float] = {}
        self._held_back: dict[Hashable, int] = {}

    def due(self, kind: Hashable, interval_s: float | None = None) -> Due | None:
        """Count one of `kind`; None if a line about it went out less than `interval_s`
        ago (default: the log's), else what the line due now should say."""
        now_s = self._clock()
        interval_s = self._interval_s if interval_s is None else interval_s
        with self._lock:
            self.counts[kind] += 1
            last_s = self._last_s.get(kind)
            if last_s is not None and now_s - last_s < interval_s:
                self._held_back[kind] = self._held_back.get(kind, 0) + 1
                return None
            self._last_s[kind] = now_s
            return Due(self.counts[kind], self._held_back.pop(kind, 0))

    def log(self, kind: Hashable, level: int, msg: str, *args: object) -> bool:
        """Log one line; True if it went out at `level`, False if it was held back to DEBUG."""
        due = self.due(kind)
        if due is None:
            self._logger.debug(msg, *args)
            return False
        if due.held_back:
            msg += " (%d more like it in the last %.0f s)"
            args = (*args, due.held_back, self._interval_s)
        self._logger.log(level, msg, *args)
        return True

    def clear(self) -> None:
        """Forget every kind (a test's fresh start)."""
        with self._lock:
            self.counts.clear()
            self._last_s.clear()
            self._held_back.clear()
