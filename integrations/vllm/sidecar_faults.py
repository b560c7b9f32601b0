"""How the connector lives with a sidecar that fails: count, log once per kind, stop asking.

No sidecar behaviour may fail a request or the engine: every fault becomes a miss or
a recompute. `FaultLog` counts faults by kind and logs the first of each kind (later
ones at most once a minute, as a count), never a traceback per chunk; the house's one
rate-limited log (`common.log_limits`) in the connector's words. `sidecar_breaker()`
stops lookups after consecutive failures and lets one probe through per cool-down,
doubling it while the sidecar keeps failing (the house's one `common.breaker`).
Thread-safe; knows nothing of vLLM or gRPC.
"""

from __future__ import annotations

import logging

from kvsplice.common.breaker import BreakerConfig, BreakerWords, CircuitBreaker
from kvsplice.common.log_limits import RateLimitedLog

logger = logging.getLogger(__name__)

REPEAT_LOG_INTERVAL_S = 60.0
# Three failed lookups in a row open it; one probe per cool-down, 1 s doubling to 30 s.
SIDECAR_BREAKER = BreakerConfig(
    failure_threshold=3, probe_interval_s=1.0, max_probe_interval_s=30.0,
    quiet_after_recovery_s=0.0,
)  # fmt: skip
SIDECAR_WORDS = BreakerWords(
    opened="{name} failed {failures} calls in a row: no lookups for {wait_s:.1f} s",
    closed="{name} answers again: lookups resume",
)


class FaultLog(RateLimitedLog):
    """The connector's faults, counted by kind (`counts`)."""

    def __init__(self) -> None:
        super().__init__(logger, REPEAT_LOG_INTERVAL_S)

    def record(self, kind: str, detail: object) -> None:
        """Count one fault of `kind`; log it if it is the first or a minute has passed."""
        due = self.due(kind)
        if due is None:
            return
        if due.total == 1:
            logger.warning("kvsplice %s: %s (served by recomputing; logged once)", kind, detail)
        else:
            logger.warning("kvsplice %s: %d so far, latest: %s", kind, due.total, detail)


def sidecar_breaker() -> CircuitBreaker:
    """Closed: ask the sidecar. Open: answer a miss at once, one probe per cool-down."""
    return CircuitBreaker("kvsplice sidecar", SIDECAR_BREAKER, words=SIDECAR_WORDS)
