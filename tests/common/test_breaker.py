"""The one circuit breaker: trips on consecutive faults, fails fast, probes back (a probe
thread for the shared tier, one call let through per doubling interval for the sidecar)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from kvsplice.common import breaker as breaker_module
from kvsplice.common.breaker import BreakerConfig, BreakerWords, CircuitBreaker
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
    with pytest.raises(ValueError, match=r"max_probe_interval_s 0\.1 < probe_interval_s"):
        BreakerConfig(probe_interval_s=0.5, max_probe_interval_s=0.1)


HALF_OPEN = BreakerConfig(3, probe_interval_s=1.0, max_probe_interval_s=2.0)
WORDS = BreakerWords(
    opened="{name} failed {failures} in a row: {wait_s:.1f} s", closed="{name} back"
)


class FakeTime:
    """The breaker's clocks (monotonic and wall), moved by hand."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def monotonic(self) -> float:
        return self.now_s

    def time(self) -> float:
        return self.now_s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(breaker_module, "time", fake)
    return fake


def test_without_a_probe_one_call_goes_through_per_interval_doubling_while_it_fails(
    clock: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvsplice.common.breaker")
    breaker = CircuitBreaker("sidecar", HALF_OPEN, words=WORDS)
    for _ in range(3):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.is_open and breaker.num_trips == 1
    assert not breaker.allow()  # the cool-down: a miss at once
    clock.now_s += 1.0
    assert breaker.allow() and not breaker.allow()  # one call, the rest wait for it
    breaker.record_failure("still down")
    clock.now_s += 1.5
    assert not breaker.allow()  # the interval doubled to 2 s (its ceiling)
    clock.now_s += 0.5
    assert breaker.allow()
    breaker.record_success()
    assert not breaker.is_open and breaker.allow() and breaker.num_trips == 1
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["sidecar failed 3 in a row: 1.0 s", "sidecar back"]


def test_a_trip_right_after_a_recovery_is_not_logged(
    clock: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvsplice.common.breaker")
    breaker = CircuitBreaker("sidecar", BreakerConfig(1, 1.0, quiet_after_recovery_s=60.0))
    breaker.record_failure("down")
    clock.now_s += 2.0
    assert breaker.allow()
    breaker.record_success()
    breaker.record_failure("down again")  # flapping: counted, not logged
    assert breaker.num_trips == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "sidecar unreachable (down): failing fast",
        "sidecar reachable again after 2.0 s",
    ]
