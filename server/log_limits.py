"""A log that says each kind of thing at most once per interval, counting what it held back.

Hostile or broken callers can provoke a fault per request; this keeps the log's growth
bounded by the number of kinds, not the number of requests. Held-back lines go to DEBUG.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable


class RateLimitedLog:
    """`log(kind, level, msg, *args)`: at `level` once per `interval_s` per kind, else DEBUG."""

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
        self._last_s: dict[Hashable, float] = {}
        self._held_back: dict[Hashable, int] = {}

    def log(self, kind: Hashable, level: int, msg: str, *args: object) -> bool:
        """Log one line; True if it went out at `level`, False if it was held back to DEBUG."""
        now_s = self._clock()
        with self._lock:
            last_s = self._last_s.get(kind)
            if last_s is not None and now_s - last_s < self._interval_s:
                self._held_back[kind] = self._held_back.get(kind, 0) + 1
                held_back = -1
            else:
                self._last_s[kind] = now_s
                held_back = self._held_back.pop(kind, 0)
        if held_back < 0:
            self._logger.debug(msg, *args)
            return False
        if held_back:
            msg += " (%d more like it in the last %.0f s)"
            args = (*args, held_back, self._interval_s)
        self._logger.log(level, msg, *args)
        return True
