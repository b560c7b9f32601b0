"""How the connector lives with a sidecar that fails: count, log once per kind, stop asking.

No sidecar behaviour may fail a request or the engine: every fault becomes a miss or
a recompute. `FaultLog` counts faults by kind and logs the first of each kind (later
ones at most once a minute, as a count), never a traceback per chunk. `Breaker` stops
lookups after consecutive failures and lets one probe through per cool-down, doubling
it while the sidecar keeps failing. Thread-safe; knows nothing of vLLM or gRPC.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

logger = logging.getLogger(__name__)

REPEAT_LOG_INTERVAL_S = 60.0


class FaultLog:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._last_logged_s: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, kind: str, detail: object) -> None:
        """Count one fault of `kind`; log it if it is the first or a minute has passed."""
        now = time.monotonic()
        with self._lock:
            self.counts[kind] += 1
            count = self.counts[kind]
            last = self._last_logged_s.get(kind)
            if last is not None and now - last < REPEAT_LOG_INTERVAL_S:
                return
            self._last_logged_s[kind] = now
        if count == 1:
            logger.warning("kvsplice %s: %s (served by recomputing; logged once)", kind, detail)
        else:
            logger.warning("kvsplice %s: %d so far, latest: %s", kind, count, detail)


class Breaker:
    """Closed: ask the sidecar. Open: answer a miss at once, one probe per cool-down."""

    def __init__(
        self, failure_threshold: int = 3, cooldown_s: float = 1.0, max_cooldown_s: float = 30.0
    ) -> None:
        self.failure_threshold = failure_threshold
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.num_trips = 0
        self._failures = 0
        self._cooldown_s = cooldown_s
        self._open_until_s: float | None = None
        self._probing = False
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._open_until_s is not None

    def allow(self) -> bool:
        """Whether a call may go to the sidecar now (closed, or the one probe when due)."""
        with self._lock:
            if self._open_until_s is None:
                return True
            if self._probing or time.monotonic() < self._open_until_s:
                return False
            self._probing = True
            return True

    def succeeded(self) -> None:
        with self._lock:
            if self._open_until_s is not None:
                logger.warning("kvsplice sidecar answers again: lookups resume")
            self._failures, self._open_until_s, self._probing = 0, None, False
            self._cooldown_s = self.base_cooldown_s

    def failed(self) -> None:
        with self._lock:
            self._failures += 1
            if self._probing:  # the probe failed: wait longer
                self._cooldown_s = min(self._cooldown_s * 2, self.max_cooldown_s)
            elif self._failures < self.failure_threshold or self._open_until_s is not None:
                return
            else:
                self.num_trips += 1
                logger.warning(
                    "kvsplice sidecar failed %d calls in a row: no lookups for %.1f s",
                    self._failures, self._cooldown_s,
                )  # fmt: skip
            self._probing = False
            self._open_until_s = time.monotonic() + self._cooldown_s
