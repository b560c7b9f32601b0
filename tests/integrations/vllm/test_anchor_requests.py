"""A request in the anchor mode through the scheduler half: what it loads, what a refusal of
the gate makes of it (recomputed, told why, then anchored), which runs it may take.

The sidecar holds the request's first 8 tokens as an exact chain and its next 16 in a
segment another request computed (exact or not, per test). Broken variants: a plain load
fault (not a refusal) must neither say the gate refused nor make anchors.
"""

from __future__ import annotations

import time

import pytest
import scheduler_fakes as fakes

from kvsplice.common.keys import root_key
from kvsplice.common.segment import chained_meta
from kvsplice.integrations.vllm.scheduler_side import SchedulerSide
from kvsplice.integrations.vllm.transfer_specs import LoadFaultNews, WorkerNews
from kvsplice.storeclient.results import SegmentRef, SimilarCandidate

PREFIX = list(range(10, 18))  # the exact chain: 2 blocks
RUN = list(range(100, 116))  # stored elsewhere: 4 blocks
PROMPT = [*PREFIX, *RUN, 5]
REFUSAL = "0 stored anchor(s) for this context; KVComm's gate wants 2"


class RunStore(fakes.FakeStore):
    """The chain over PREFIX, and RUN as a segment computed at position 40 elsewhere."""

    run_exact: bool = True

    def find_similar(
        self, root: str, window: list[int], limit: int, with_token_ids: bool = False
    ) -> list[SimilarCandidate]:
        ref = SegmentRef(self.meta.context_key, 40, len(RUN), 0, 2, 100)
        tokens = tuple(RUN) if with_token_ids else ()
        return [SimilarCandidate(ref, 1.0, True, False, len(RUN), tokens, self.run_exact)]

    def get_segment(self, segment_id: str, *, model_fingerprint: str) -> tuple | None:
        raise AssertionError("the scheduler half reads no payload (the search has the tokens)")

    @property
    def meta(self) -> object:
        return chained_meta("ns", fakes.FINGERPRINT, root_key(fakes.FINGERPRINT), tuple(RUN), 40, 2,
                            created_at_s=time.time(), exact=self.run_exact)  # fmt: skip


def side_and_request(reuse: str, run_exact: bool = True) -> tuple[SchedulerSide, fakes.FakeRequest]:
    store = RunStore(PREFIX)
    store.run_exact = run_exact
    side = SchedulerSide(fakes.FakeClients(store), fakes.FINGERPRINT, fakes.BLOCK, fakes.BLOCK,  # type: ignore[arg-type]
                         engine_modes=("naive", "anchor"), lookup_wait_s=10.0)  # fmt: skip
    request = fakes.FakeRequest("r", list(PROMPT))
    request.kv_transfer_params = {"kvsplice": {"reuse": reuse}}  # type: ignore[attr-defined]
    return side, request


def first_step(side: SchedulerSide, request: fakes.FakeRequest) -> list:
    promised = side.num_new_matched_tokens(request, 0)
    assert promised == 24  # the chain's 8 and the run's 16
    side.after_alloc(request, list(range(7)), 24)
    step = fakes.Step([fakes.NewReq("r", (list(range(7)),), 24)], num_scheduled_tokens={"r": 1})
    return side.build_step(step)[0]


@pytest.mark.parametrize("broken", [False, True], ids=["refused", "broken-a-load-fault"])
def test_a_refused_request_is_recomputed_told_why_and_anchored_once_computed(broken: bool) -> None:
    side, request = side_and_request("anchor")
    (load,) = first_step(side, request)
    assert load.mode == "anchor" and [s.start for s in load.spans] == [8]
    refusal = None if broken else REFUSAL
    side.absorb(WorkerNews(faults=[LoadFaultNews("r", "ns", 8, None, refusal)]))
    assert side.take_anchors() == []  # not computed yet
    # vLLM recomputes from token 8: this step computes tokens 8..25
    cached = fakes.Cached(["r"], set(), [None], [8])
    side.build_step(fakes.Step(scheduled_cached_reqs=cached, num_scheduled_tokens={"r": 17}))
    anchors = side.take_anchors()
    report = side.finished(request)
    assert report is not None
    ours = report["kvsplice"]
    assert ours["mode"] == "anchor" and ours["approximate_tokens"] == (16 if broken else 0)
    if broken:  # a load fault is no refusal: nothing anchored, nothing said of a gate
        assert anchors == [] and "anchor gate" not in ours.get("reason", "")
        return
    assert "the anchor gate refused (0 stored anchor(s)" in ours["reason"]
    (spec,) = anchors
    assert [s.start for s in spec.spans] == [8] and spec.block_ids == (2, 3, 4, 5)
    assert spec.token_ids == tuple(PROMPT[:24])


def test_gated_takes_the_policy_s_first_engine_mode_and_anchor_only_exact_runs() -> None:
    """ "gated" runs the first admitted engine mode (naive here); the anchor mode takes no run
    computed past a fence (its K/V is of no base an offset was measured against)."""
    side, request = side_and_request("gated")
    (load,) = first_step(side, request)
    assert load.mode == "naive"
    side, request = side_and_request("anchor", run_exact=False)
    assert side.num_new_matched_tokens(request, 0) == 8  # the chain only
    side, request = side_and_request("gated", run_exact=False)
    assert side.num_new_matched_tokens(request, 0) == 24  # naive takes it


def test_a_request_asking_for_a_mode_the_policy_does_not_admit_gets_exact_reuse() -> None:
    store = RunStore(PREFIX)
    side = SchedulerSide(fakes.FakeClients(store), fakes.FINGERPRINT, fakes.BLOCK, fakes.BLOCK,  # type: ignore[arg-type]
                         engine_modes=("naive",), lookup_wait_s=10.0)  # fmt: skip
    request = fakes.FakeRequest("r", list(PROMPT))
    request.kv_transfer_params = {"kvsplice": {"reuse": "anchor"}}  # type: ignore[attr-defined]
    assert side.num_new_matched_tokens(request, 0) == 8
    report = side.finished(request)
    assert report is not None and report["kvsplice"]["admitted"] is False
