"""The shared tier's circuit breaker: trips on consecutive faults, fails fast, probes back."""

from __future__ import annotations

import threading
import time

import pytest

from kvsplice.common.breaker import BreakerConfig, CircuitBreaker
from kvsplice.common.errors import StoreUnavailable


class FlakyProbe:
    def __init__(self) -> None:
        self.up = threading.Event()
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if not self.up.is_set():
            raise ConnectionError("still down")


def make_breaker(probe: FlakyProbe, threshold: int = 2) -> CircuitBreaker:
    return CircuitBreaker("test tier", BreakerConfig(threshold, probe_interval_s=0.01), probe)


def test_it_opens_only_after_consecutive_faults() -> None:
    breaker = make_breaker(FlakyProbe(), threshold=3)
    breaker.record_failure(TimeoutError("1"))
    breaker.record_failure(TimeoutError("2"))
    breaker.record_success()  # resets the run
    breaker.record_failure(TimeoutError("3"))
    breaker.record_failure(TimeoutError("4"))
    assert not breaker.is_open
    breaker.record_failure(TimeoutError("5"))
    assert breaker.is_open and breaker.state.num_trips == 1
    assert breaker.state.last_error == "5"
    breaker.close()


def test_an_open_breaker_fails_fast_until_the_probe_succeeds_then_calls_back() -> None:
    probe = FlakyProbe()
    breaker = make_breaker(probe)
    recovered = threading.Event()
    breaker.add_recovery_callback(recovered.set)
    breaker.trip(ConnectionError("refused"))
    # fails fast: the open state's own error, no call made
    with pytest.raises(StoreUnavailable, match="degraded: refused"):
        breaker.check()
    deadline = time.monotonic() + 10
    while probe.calls < 2:  # the prober retries while the tier stays down
        assert time.monotonic() < deadline, "the prober did not retry"
        time.sleep(0.01)
    assert breaker.is_open and not recovered.is_set()
    probe.up.set()
    assert recovered.wait(2.0)
    assert not breaker.is_open
    breaker.check()  # closed: no raise
    breaker.close()


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="failure_threshold 0"):
        BreakerConfig(failure_threshold=0)
    with pytest.raises(ValueError, match="probe_interval_s"):
        BreakerConfig(probe_interval_s=0.0)
