"""`ReuseForecast` against direct computation: a session's forecast wait is the mean remaining
wait of the waits longer than its idle time, scaled by the chance of a return (expiries
count against it), over a bounded window; an unheld segment's is its mean time between uses,
kept across an eviction it is put again after."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.storage.reuse_forecast import ReuseForecast


def direct_wait_s(waits: list[float], num_expired: int, idle_s: float) -> float:
    longer = [wait for wait in waits if wait > idle_s]
    if not longer:
        return idle_s if num_expired == 0 else math.inf
    remaining_s = sum(longer) / len(longer) - idle_s
    return remaining_s * (len(longer) + num_expired) / len(longer)


def test_a_session_wait_is_the_remaining_wait_over_the_chance_of_a_return() -> None:
    forecast = ReuseForecast(max_remembered=0)
    for wait_s in (10.0, 20.0, 30.0):
        forecast.returned(wait_s)
    assert forecast.session_wait_s(0.0) == 20.0
    assert forecast.session_wait_s(15.0) == 10.0  # (20 + 30) / 2 - 15
    forecast.expired()  # one never came back: 2 of 3 sessions idle 15 s did
    assert forecast.session_wait_s(15.0) == 15.0
    assert forecast.session_wait_s(35.0) == math.inf  # longer than any return


def test_with_no_wait_as_long_and_no_expiry_the_elapsed_time_is_the_forecast() -> None:
    forecast = ReuseForecast(max_remembered=0)
    assert forecast.session_wait_s(7.0) == 7.0
    forecast.returned(5.0)
    assert forecast.session_wait_s(7.0) == 7.0
    assert forecast.session_wait_s(1.0) == 4.0


@settings(max_examples=60, deadline=None)
@given(
    outcomes=st.lists(
        st.one_of(st.floats(0.001, 500.0), st.just(math.inf)), min_size=1, max_size=60
    ),
    idle_s=st.floats(0.0, 600.0),
    max_outcomes=st.integers(1, 20),
)
def test_the_forecast_equals_direct_computation_over_the_window(
    outcomes: list[float], idle_s: float, max_outcomes: int
) -> None:
    forecast = ReuseForecast(max_remembered=0, max_outcomes=max_outcomes)
    for outcome in outcomes:
        if outcome == math.inf:
            forecast.expired()
        else:
            forecast.returned(outcome)
        forecast.session_wait_s(idle_s)  # read between records: the cached sums stay right
    window = outcomes[-max_outcomes:]
    waits = [outcome for outcome in window if outcome != math.inf]
    expected = direct_wait_s(waits, len(window) - len(waits), idle_s)
    assert math.isclose(forecast.session_wait_s(idle_s), expected, rel_tol=1e-9, abs_tol=1e-9)


def test_a_segment_wait_is_its_mean_time_between_uses_across_an_eviction() -> None:
    remembering = ReuseForecast(max_remembered=4)
    forgetting = ReuseForecast(max_remembered=0)
    for forecast in (remembering, forgetting):
        forecast.stored(b"doc", 0.0)
        forecast.read(b"doc", 10.0)
        forecast.forget(b"doc")  # evicted
        forecast.stored(b"doc", 30.0)  # put again: its reader missed it
    assert remembering.segment_wait_s(b"doc", 40.0) == 20.0  # 40 s since its put, 2 uses
    assert forgetting.segment_wait_s(b"doc", 40.0) == 10.0  # negative control: a fresh put
    remembering.read(b"loaded", 35.0)  # stored before tracking began: counted from here
    assert remembering.segment_wait_s(b"loaded", 40.0) == 5.0
