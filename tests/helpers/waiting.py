"""Polling until a condition holds, with a deadline (no wall-clock assertion on speed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    probe: Callable[[], T], accept: Callable[[T], bool], timeout_s: float, interval_s: float = 0.02
) -> T:
    """`probe()` until `accept` takes its value (returned) or `timeout_s` passes (AssertionError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if accept(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not accepted within {timeout_s} s: {value!r}")
        time.sleep(interval_s)
