"""Wall-clock medians for benchmarks and demos: warm up, repeat, take the median."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def median_seconds(fn: Callable[[], T], repeats: int, warmup: int = 1) -> tuple[float, T]:
    """Median wall time of `repeats` calls of `fn` after `warmup` untimed calls, and the last result."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats {repeats} must be >= 1 and warmup {warmup} >= 0")
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    for _ in range(repeats):  # at least once
        start = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), result
