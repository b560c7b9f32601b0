"""A circuit breaker for the shared tier: fail fast while it is down, probe it in the background.

Owns the open/closed state, the background probe and recovery callbacks; what a call
or a probe does belongs to the caller (`redis_connection`). Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvsplice.common.errors import StoreUnavailable

logger = logging.getLogger(__name__)

_QUIET_AFTER_RECOVERY_S = 10.0


@dataclass(frozen=True)
class BreakerConfig:
    """Open after `failure_threshold` consecutive faults; probe every `probe_interval_s`."""

    failure_threshold: int = 2
    probe_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold {self.failure_threshold} must be >= 1")
        if not self.probe_interval_s > 0:
            raise ValueError(f"probe_interval_s {self.probe_interval_s} must be > 0")


@dataclass(frozen=True)
class BreakerState:
    """What `/readyz` shows: closed (healthy) or open (degraded), since when and why."""

    is_open: bool
    since_s: float
    num_trips: int
    last_error: str


class CircuitBreaker:
    """Closed: calls go through. Open: `check()` raises `StoreUnavailable` at once.

    NOTE: an open breaker never lets a request through to test the tier (a "half-open"
    call would make one request per interval wait a full timeout on a hung server);
    a daemon thread runs `probe` until it succeeds, then closes the breaker and runs
    the recovery callbacks (republishing what was written meanwhile).
    """

    def __init__(self, name: str, config: BreakerConfig, probe: Callable[[], None]) -> None:
        self.name = name
        self._config = config
        self._probe = probe
        self._lock = threading.Lock()
        self._failures = 0
        self._state = BreakerState(False, time.time(), 0, "")
        self._on_recover: list[Callable[[], None]] = []
        self._recovered_at_s = float("-inf")
        self._trip_logged = False
        self._shutdown = threading.Event()
        self._prober: threading.Thread | None = None

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def is_open(self) -> bool:
        return self.state.is_open

    def add_recovery_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._on_recover.append(callback)

    def check(self) -> None:
        """Raise `StoreUnavailable` if the breaker is open (the tier is degraded)."""
        state = self.state
        if state.is_open:
            raise StoreUnavailable(f"{self.name} is degraded: {state.last_error}")

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0

    def record_failure(self, error: BaseException, log: bool = True) -> None:
        """Count a fault; the `failure_threshold`-th in a row opens the breaker."""
        with self._lock:
            self._failures += 1
            if self._state.is_open or self._failures < self._config.failure_threshold:
                return
            now_s = time.time()
            # a flapping tier (a failover under way) logs its first trip, not every one
            flapping = now_s - self._recovered_at_s < _QUIET_AFTER_RECOVERY_S
            self._state = BreakerState(True, now_s, self._state.num_trips + 1, str(error))
            self._trip_logged = log and not flapping
        if self._trip_logged:
            logger.warning("%s unreachable (%s): degraded, local tiers serve", self.name, error)
        self._start_prober()

    def trip(self, error: BaseException) -> None:
        """Open at once (unreachable at start: the caller has logged why)."""
        with self._lock:
            self._failures = self._config.failure_threshold - 1
        self.record_failure(error, log=False)

    def close(self) -> None:
        """Stop probing (shutdown); idempotent."""
        self._shutdown.set()

    def _start_prober(self) -> None:
        with self._lock:
            if self._prober is not None and self._prober.is_alive():
                return
            self._prober = threading.Thread(
                target=self._probe_until_up, name=f"{self.name}-probe", daemon=True
            )
            self._prober.start()

    def _probe_until_up(self) -> None:
        while not self._shutdown.wait(self._config.probe_interval_s):
            try:
                self._probe()
            except Exception as exc:  # still down: keep the breaker open, try again later
                logger.debug("%s probe failed: %s", self.name, exc)
                with self._lock:
                    self._state = BreakerState(
                        True, self._state.since_s, self._state.num_trips, str(exc)
                    )
                continue
            self._recover()
            return

    def _recover(self) -> None:
        with self._lock:
            self._recovered_at_s = time.time()
            down_s = self._recovered_at_s - self._state.since_s
            self._failures = 0
            self._state = BreakerState(False, self._recovered_at_s, self._state.num_trips, "")
            callbacks = list(self._on_recover)
            level = logging.WARNING if self._trip_logged else logging.DEBUG
        logger.log(level, "%s reachable again after %.1f s: sharing resumes", self.name, down_s)
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a failed republish is retried at the next recovery
                logger.exception("%s recovery callback failed", self.name)
