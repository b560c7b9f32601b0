"""The one circuit breaker: fail fast while a dependency is down, find out when it is back.

Closed, calls go through; `failure_threshold` faults in a row open it. Open, `allow()`
says no (`check()` raises `StoreUnavailable`) until it closes again, one of two ways:
- with a `probe` (the shared tier): a daemon thread runs it every `probe_interval_s`
  until it succeeds; no call is let through to test the dependency, so no request waits
  a full timeout on a hung server;
- without one (the vLLM connector's sidecar): half-open, `allow()` lets one call through
  per interval, the interval doubling up to `max_probe_interval_s` while that call fails.
Owns the state, recovery callbacks and its two log lines (`BreakerWords`); what a call
or a probe does belongs to the caller. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvsplice.common.errors import StoreUnavailable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BreakerConfig:
    """Open after `failure_threshold` consecutive faults; probe every `probe_interval_s`
    (a half-open breaker doubles it per failed call, up to `max_probe_interval_s`; None:
    never). A trip within `quiet_after_recovery_s` of a recovery (a failover under way)
    is not logged."""

    failure_threshold: int = 2
    probe_interval_s: float = 0.5
    max_probe_interval_s: float | None = None
    quiet_after_recovery_s: float = 10.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError(f"failure_threshold {self.failure_threshold} must be >= 1")
        if not self.probe_interval_s > 0:
            raise ValueError(f"probe_interval_s {self.probe_interval_s} must be > 0")
        if self.max_probe_interval_s is not None and (
            self.max_probe_interval_s < self.probe_interval_s
        ):
            raise ValueError(
                f"max_probe_interval_s {self.max_probe_interval_s} < "
                f"probe_interval_s {self.probe_interval_s}"
            )


@dataclass(frozen=True)
class BreakerWords:
    """The two lines a breaker logs, `str.format`ted: `opened` with `name`, `error`,
    `failures` and `wait_s`; `closed` with `name` and `down_s`."""

    opened: str = "{name} unreachable ({error}): failing fast"
    closed: str = "{name} reachable again after {down_s:.1f} s"


@dataclass(frozen=True)
class BreakerState:
    """What `/readyz` shows: closed (healthy) or open (degraded), since when and why."""

    is_open: bool
    since_s: float
    num_trips: int
    last_error: str


class CircuitBreaker:
    """Closed: calls go through. Open: `allow()` is False and `check()` raises at once."""

    def __init__(
        self,
        name: str,
        config: BreakerConfig,
        probe: Callable[[], None] | None = None,
        words: BreakerWords = BreakerWords(),
    ) -> None:
        self.name = name
        self.config = config
        self.words = words
        self._probe = probe
        self._lock = threading.Lock()
        self._failures = 0
        self._state = BreakerState(False, time.time(), 0, "")
        self._interval_s = config.probe_interval_s
        self._retry_at_s = 0.0  # half-open: when (monotonic) the next call may go
        self._probing = False  # half-open: the one call let through is out
        self._on_recover: list[Callable[[], None]] = []
        self._recovered_at_s = float("-inf")
        self._trip_logged = False
        self._shutdown = threading.Event()
        self._prober: threading.Thread | None = None

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    @property
    def is_open(self) -> bool:
        return self.state.is_open

    @property
    def num_trips(self) -> int:
        return self.state.num_trips

    def add_recovery_callback(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._on_recover.append(callback)

    def allow(self) -> bool:
        """Whether a call may go now: closed, or (half-open) the one call when it is due."""
        with self._lock:
            if not self._state.is_open:
                return True
            if self._probe is not None or self._probing or time.monotonic() < self._retry_at_s:
                return False
            self._probing = True
            return True

    def check(self) -> None:
        """Raise `StoreUnavailable` unless a call may go now (see `allow`)."""
        if not self.allow():
            raise StoreUnavailable(f"{self.name} is degraded: {self.state.last_error}")

    def record_success(self) -> None:
        """A call succeeded; without a probe, that closes an open breaker."""
        with self._lock:
            self._failures = 0
            closes = self._probe is None and self._state.is_open
        if closes:
            self._recover()

    def record_failure(self, error: BaseException | str = "", log: bool = True) -> None:
        """Count a fault; the `failure_threshold`-th in a row opens the breaker."""
        with self._lock:
            self._failures += 1
            if self._probing:  # the one call let through failed: wait longer
                self._probing = False
                ceiling = self.config.max_probe_interval_s or self.config.probe_interval_s
                self._interval_s = min(self._interval_s * 2, ceiling)
                self._retry_at_s = time.monotonic() + self._interval_s
                self._state = BreakerState(
                    True, self._state.since_s, self._state.num_trips, str(error)
                )
                return
            if self._state.is_open or self._failures < self.config.failure_threshold:
                return
            now_s = time.time()
            flapping = now_s - self._recovered_at_s < self.config.quiet_after_recovery_s
            self._state = BreakerState(True, now_s, self._state.num_trips + 1, str(error))
            self._trip_logged = log and not flapping
            self._retry_at_s = time.monotonic() + self._interval_s
            failures, wait_s = self._failures, self._interval_s
        if self._trip_logged:
            logger.warning(
                self.words.opened.format(
                    name=self.name, error=error, failures=failures, wait_s=wait_s
                )
            )
        if self._probe is not None:
            self._start_prober(self._probe)

    def trip(self, error: BaseException) -> None:
        """Open at once (unreachable at start: the caller has logged why)."""
        with self._lock:
            self._failures = self.config.failure_threshold - 1
        self.record_failure(error, log=False)

    def close(self) -> None:
        """Stop probing (shutdown); idempotent."""
        self._shutdown.set()

    def _start_prober(self, probe: Callable[[], None]) -> None:
        with self._lock:
            if self._prober is not None and self._prober.is_alive():
                return
            self._prober = threading.Thread(
                target=self._probe_until_up, args=(probe,), name=f"{self.name}-probe", daemon=True
            )
            self._prober.start()

    def _probe_until_up(self, probe: Callable[[], None]) -> None:
        while not self._shutdown.wait(self.config.probe_interval_s):
            try:
                probe()
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
            if not self._state.is_open:  # closed meanwhile by another success
                return
            self._recovered_at_s = time.time()
            down_s = self._recovered_at_s - self._state.since_s
            self._failures, self._probing = 0, False
            self._interval_s = self.config.probe_interval_s
            self._state = BreakerState(False, self._recovered_at_s, self._state.num_trips, "")
            callbacks = list(self._on_recover)
            level = logging.WARNING if self._trip_logged else logging.DEBUG
        logger.log(level, self.words.closed.format(name=self.name, down_s=down_s))
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a failed republish is retried at the next recovery
                logger.exception("%s recovery callback failed", self.name)
