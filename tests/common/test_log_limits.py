"""RateLimitedLog: one line per kind and interval at its level, the rest at DEBUG, counted;
`due` for callers that word their own lines."""

from __future__ import annotations

import logging

import pytest

from kvsplice.common.log_limits import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_one_line_per_kind_and_interval_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="limits")
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("limits"), 10.0, clock)
    sent = [log.log("a", logging.WARNING, "bad %s", i) for i in range(5)]
    assert sent == [True, False, False, False, False]
    assert log.log("b", logging.WARNING, "other")
    clock.now_s = 10.0
    assert log.log("a", logging.WARNING, "bad again")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["bad 0", "other", "bad again (4 more like it in the last 10 s)"]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 4


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        RateLimitedLog(logging.getLogger("limits"), -1.0)


def test_due_counts_every_one_and_says_what_was_held_back() -> None:
    clock = Clock()
    log = RateLimitedLog(logging.getLogger("limits"), 10.0, clock)
    assert log.due("a") == (1, 0)
    assert log.due("a") is None and log.due("a") is None
    assert log.due("a", interval_s=0.0) == (4, 2)  # a caller's own interval
    clock.now_s = 10.0
    assert log.due("a") == (5, 0)
    assert log.counts["a"] == 5
    log.clear()
    assert log.due("a") == (1, 0)
