"""The scheduler half when the sidecar is slow, refuses or fails, and when a load faults:
misses, never exceptions or a blocked scheduler; the breaker; the chain rewound."""

from __future__ import annotations

import time

import pytest
from helpers.waiting import wait_for
from scheduler_fakes import (
    BlockingStore,
    Cached,
    FakeRequest,
    NewReq,
    Step,
    make_blocking_side,
    make_side,
)
from test_scheduler_side import promised_and_scheduled

from kvsplice.common.errors import (
    InvalidRequest,
    KvspliceError,
    PermissionDenied,
    StoreUnavailable,
)
from kvsplice.integrations.vllm.transfer_specs import (
    LoadFaultNews,
    SaveSpec,
    WorkerNews,
)


def test_a_slow_lookup_never_blocks_the_scheduler_it_answers_later() -> None:
    prompt = list(range(10, 22))
    store = BlockingStore(prompt)
    side = make_blocking_side(store)
    request = FakeRequest("r", prompt)
    # the sidecar answers only once released: a blocking lookup could not return None here
    assert side.num_new_matched_tokens(request, 0) is None  # "ask again next step"
    assert side.num_new_matched_tokens(request, 0) is None
    store.release.set()
    answer = wait_for(
        lambda: side.num_new_matched_tokens(request, 0), lambda n: n is not None, timeout_s=30.0
    )
    assert answer == 8 and len(store.lookups) == 1


def test_a_lookup_past_its_deadline_is_a_miss() -> None:
    store = BlockingStore(list(range(10, 22)))
    side = make_blocking_side(store, lookup_timeout_s=0.05)
    request = FakeRequest("r", list(range(10, 22)))
    assert side.num_new_matched_tokens(request, 0) is None
    time.sleep(0.1)
    assert side.num_new_matched_tokens(request, 0) == 0
    assert side.lookups.num_failed_lookups == 1
    store.release.set()


@pytest.mark.parametrize(
    "error",
    [
        PermissionDenied("not your namespace"),
        InvalidRequest("prompt too long"),
        KvspliceError("store answered INTERNAL"),
        RuntimeError("a bug"),
    ],
)
def test_a_refused_or_failed_lookup_is_a_miss_never_an_exception(error: Exception) -> None:
    store = BlockingStore(list(range(10, 22)), error=error)
    store.release.set()
    side = make_blocking_side(store, lookup_wait_s=5.0)
    for request_id in ("r1", "r2"):
        assert side.num_new_matched_tokens(FakeRequest(request_id, list(range(10, 22))), 0) == 0
    assert side.faults.counts  # counted (and logged once per kind)
    assert side.lookups.num_failed_lookups == 2


def test_a_failing_sidecar_opens_the_breaker_then_it_is_not_asked() -> None:
    store = BlockingStore(list(range(10, 22)), error=StoreUnavailable("connection refused"))
    store.release.set()
    side = make_blocking_side(store, lookup_wait_s=5.0)
    for i in range(10):
        assert side.num_new_matched_tokens(FakeRequest(f"r{i}", list(range(10, 22))), 0) == 0
    assert len(store.lookups) == 3  # the breaker opened after three failures
    assert side.lookups.breaker.is_open and side.lookups.num_failed_lookups == 3


def test_a_chunk_counts_as_stored_only_once_the_sidecar_acknowledged_it() -> None:
    prompt = list(range(10, 19))
    side, _ = make_side([])

    def saves_of(request_id: str) -> list[SaveSpec]:
        side.num_new_matched_tokens(FakeRequest(request_id, prompt), 0)
        step = Step([NewReq(request_id, ([0, 1, 2],), 0)], num_scheduled_tokens={request_id: 9})
        return side.build_step(step)[1]

    first = saves_of("r1")
    assert len(first) == 2 and saves_of("r2") == []  # in flight: not put twice
    side.absorb(WorkerNews(failed=[(s.namespace, s.key) for s in first]))  # dropped / failed
    again = saves_of("r3")
    assert [s.start for s in again] == [0, 4]  # put again when next computed
    side.absorb(WorkerNews(acked=[(s.namespace, s.key) for s in again]))
    # acknowledged, yet a later lookup does not find it (evicted): put again, no hole
    assert [s.start for s in saves_of("r4")] == [0, 4]


def test_a_load_fault_rewinds_the_chain_and_the_corrupt_piece_is_never_promised_again() -> None:
    prompt = list(range(10, 23))
    side, ((load,), saves, _) = promised_and_scheduled(prompt)
    bad = load.pieces[1]
    side.absorb(WorkerNews(faults=[LoadFaultNews("r", load.namespace, 4, bad.segment_id)]))
    assert side.num_faults_seen == 1
    # vLLM recomputes from token 4: those chunks are saved once computed again
    cached = Cached(["r"], set(), [None], [4])
    _, saves, _ = side.build_step(Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 9}))
    assert [(s.start, s.end) for s in saves] == [(4, 8), (8, 12)]
    # another request with this prefix is promised the good piece only
    assert side.num_new_matched_tokens(FakeRequest("r2", prompt), 0) == 4


def test_a_request_whose_load_failed_is_never_promised_past_the_fault_again() -> None:
    """vLLM's "recompute" asks the connector again for the same request; its cached answer
    would promise the failing piece again (a sidecar gone: a promise it can never keep)."""
    prompt = list(range(10, 23))
    side, ((load,), _, _) = promised_and_scheduled(prompt)
    request = FakeRequest("r", prompt)  # the same request asked again
    side.absorb(WorkerNews(faults=[LoadFaultNews("r", load.namespace, 8, None)]))  # unreachable
    assert side.num_new_matched_tokens(request, 0) == 8  # recompute: asked again from 0
    side.absorb(WorkerNews(faults=[LoadFaultNews("r", load.namespace, 0, None)]))
    assert side.num_new_matched_tokens(request, 0) == 0
    assert side.num_new_matched_tokens(FakeRequest("r2", prompt), 0) == 12  # its own lookup
