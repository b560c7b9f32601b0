"""What a looked-up request is promised: whole blocks of its exact prefix, then the runs."""

from __future__ import annotations

import time

import pytest

from kvsplice.integrations.vllm import promise as promise_module
from kvsplice.integrations.vllm.promise import Answer, Promise, promise
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.storeclient.results import PrefixLookup, SegmentRef

BLOCK = 4


def answer(matched: int, spans: tuple[ReusedSpan, ...] = ()) -> Answer:
    refs = (SegmentRef(b"k" * 32, 0, matched, 0, 2, 100),) if matched else ()
    return Answer(PrefixLookup(refs, matched), spans, 40, time.monotonic())


def test_the_exact_prefix_is_promised_in_whole_blocks_up_to_the_cap() -> None:
    assert promise(answer(16), 36, 0, BLOCK) == Promise(16)
    assert promise(answer(16), 12, 0, BLOCK) == Promise(12)  # the last token is computed
    assert promise(answer(16), 36, 20, BLOCK) == Promise(20)  # the engine has more already
    assert promise(answer(0), 36, 0, BLOCK) == Promise(0)


def test_runs_that_continue_the_prefix_are_promised_behind_a_fence() -> None:
    runs = (ReusedSpan("s", 16, 10, 0, 100), ReusedSpan("t", 26, 10, 3, 50))
    got = promise(answer(16, runs), 32, 0, BLOCK)
    assert (got.end, got.fence) == (32, 16)
    assert [(s.start, s.end) for s in got.spans] == [(16, 26), (26, 32)]
    assert promise(answer(12, runs), 32, 0, BLOCK) == Promise(12)  # they do not continue it
    assert promise(answer(16, runs), 18, 0, BLOCK) == Promise(16)  # no whole block more


def test_an_answer_goes_stale_when_the_request_grows_or_ages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fresh = answer(16)
    assert not fresh.is_stale(40) and fresh.is_stale(41)
    later = time.monotonic() + promise_module.LOOKUP_MAX_AGE_S + 1
    monkeypatch.setattr(promise_module.time, "monotonic", lambda: later)
    assert fresh.is_stale(40)
