"""`common.buffers`: a pooled receive buffer is handed out again only once nothing views it."""

from __future__ import annotations

import numpy as np
import pytest

from kvsplice.common.buffers import POPULATE_MIN_NBYTES, BufferPool, writable_buffer

NBYTES = 2 * POPULATE_MIN_NBYTES


def test_a_buffer_is_reused_only_after_every_view_is_gone() -> None:
    pool = BufferPool(8 * NBYTES)
    first = pool.take(NBYTES)
    first[:4] = b"abcd"
    array = np.frombuffer(first[:16], dtype=np.uint8)  # a view of a slice of it
    first_map = first.obj
    del first
    second = pool.take(NBYTES)
    assert second.obj is not first_map  # the numpy view still holds the first
    del array, first_map
    third = pool.take(NBYTES)
    assert bytes(third[:4]) == b"abcd" and len(third) == NBYTES  # reused, stale bytes
    assert second.obj is not third.obj


def test_the_pool_stays_within_its_budget_and_small_or_huge_buffers_are_fresh() -> None:
    pool = BufferPool(2 * NBYTES)
    held = [pool.take(NBYTES) for _ in range(3)]  # the third is over budget: not pooled
    assert sum(len(m) for m in pool._maps) <= 2 * NBYTES
    assert all(len(view) == NBYTES and not view.readonly for view in held)
    assert isinstance(pool.take(1000).obj, bytearray)
    assert isinstance(pool.take(4 * NBYTES).obj, type(writable_buffer(NBYTES).obj))


def test_fresh_buffers_are_zeroed_and_writable() -> None:
    buffer = writable_buffer(NBYTES)
    assert buffer == bytes(NBYTES) and not buffer.readonly
    with pytest.raises(ValueError, match="max_bytes"):
        BufferPool(-1)
