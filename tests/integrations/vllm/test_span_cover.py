"""Covering a request's tokens with runs stored at other positions (pure: no vLLM, no torch)."""

from __future__ import annotations

import pytest

from kvsplice.integrations.vllm.span_cover import ReusedSpan, StoredTokens, cover, trimmed

TASK = tuple(range(1000, 1040))


def test_a_shared_task_is_found_where_its_sender_computed_it() -> None:
    sender = StoredTokens("a", 0, (1,) * 30 + TASK)  # persona of 30 tokens, then the task
    mine = (2,) * 10 + TASK + (9, 9)
    spans = cover(mine, 10, len(mine), [sender], min_run=8)
    assert spans == (ReusedSpan("a", 10, 40, 30, 0),)
    assert spans[0].delta == 10 - 30


def test_runs_continue_across_segments_and_stop_at_a_gap() -> None:
    first = StoredTokens("a", 100, TASK[:20])
    second = StoredTokens("b", 120, TASK[20:])
    mine = TASK + (5,) * 20 + TASK[:10]
    spans = cover(mine, 0, len(mine), [first, second], min_run=8)
    assert [(s.segment_id, s.start, s.num_tokens) for s in spans] == [("a", 0, 20), ("b", 20, 20)]
    assert all(s.delta == -100 for s in spans)


def test_the_longest_run_wins_then_the_smallest_move() -> None:
    short = StoredTokens("short", 0, TASK[:12])
    far = StoredTokens("far", 500, TASK)
    near = StoredTokens("near", 3, TASK)
    spans = cover(TASK, 0, len(TASK), [short, far, near], min_run=8)
    assert [s.segment_id for s in spans] == ["near"]


def test_nothing_shorter_than_min_run_is_taken() -> None:
    sender = StoredTokens("a", 0, TASK[:7])
    assert cover(TASK, 0, len(TASK), [sender], min_run=8) == ()
    assert cover(TASK, 0, len(TASK), [], min_run=8) == ()
    with pytest.raises(ValueError, match="min_run"):
        cover(TASK, 0, 10, [sender], min_run=0)


def test_trimmed_cuts_runs_to_a_window() -> None:
    spans = (ReusedSpan("a", 10, 20, 5, 0), ReusedSpan("b", 30, 10, 0, 50))
    cut = trimmed(spans, 16, 34)
    assert cut == (ReusedSpan("a", 16, 14, 11, 0), ReusedSpan("b", 30, 4, 0, 50))
    assert [s.delta for s in cut] == [s.delta for s in spans]
