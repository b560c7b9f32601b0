"""Approximate KV stays fenced inside vLLM's own scheduler (modelled on vLLM's
`test_cache_pollution_prevention.py`: blocks that must not be reused are checked in the
prefix cache's own tables, through vLLM's `Scheduler` and `KVCacheManager`).

Setting: one agent computed its persona P1 and a shared task; another agent's request
(its persona P2, the task, its question) opts into approximate reuse
(`kv_transfer_params: {"kvsplice": {"reuse": "gated"}}`) on an engine whose admission
policy admits `naive`. It gets P2's stored blocks exactly and the task's K/V as the
first agent computed it, moved to its new positions. Then: (1) vLLM's prefix cache finds
none of those approximate blocks for a later request of the very same tokens; (2) every
chunk from the first approximate token on is saved off-chain: no exact lookup reaches it,
while a later opted-in request finds what the first computed there by content; (3) a
request without the opt-in,
on the same engine, gets exact reuse only; (4) an engine whose policy does not admit
`naive` gives a "gated" request exact reuse only. The sidecar is real (the session's
embedded one); the stored prefixes are saved by kvsplice's own connector halves.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import vllm_kv_connector_unit.utils as utils
from prefix_producer import PrefixProducer
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from kvsplice.client.modes.admission import AdmissionPolicy, save_policy
from kvsplice.common.keys import chunk_links, off_chain_key

BLOCK = 16
P1 = list(range(5000, 5032))  # the first agent's persona: 2 blocks
P2 = list(range(6000, 6016))  # the second agent's: 1 block
TASK = list(range(7000, 7064))  # the shared task: 4 blocks
OTHER = list(range(8000, 8032))  # what the second agent saw before (P2 stored)
QUESTION = list(range(9000, 9008))
ANSWER = list(range(9100, 9132))  # what a gated request computed past its runs: 2 blocks
PROMPT = P2 + TASK + QUESTION  # 88 tokens: 16 exact, 64 approximate, 8 computed
GATED = {"kvsplice": {"reuse": "gated"}}


def _request(request_id: str, tokens: list[int], params: dict[str, Any] | None) -> Request:
    sampling_params = SamplingParams(max_tokens=4)
    sampling_params.update_from_generation_config({}, utils.EOS_TOKEN_ID)
    request = Request(
        request_id=request_id, prompt_token_ids=tokens, sampling_params=sampling_params,
        pooling_params=None, mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK, sha256),
    )  # fmt: skip
    request.kv_transfer_params = params
    return request


def _engine_config(tmp_path: Path, admit_naive: bool) -> Any:
    """vLLM's test config with kvsplice (the conftest's), a policy admitting naive or not,
    and the sidecar holding P1 + TASK and P2 + OTHER."""
    init_none_hash(sha256)  # what vLLM's `create_request` does first
    config = utils.create_vllm_config(block_size=BLOCK)
    probe = utils.create_scheduler(config)
    fingerprint = probe.connector.fingerprint
    probe.shutdown()
    modes = ("dense", "exact", "naive") if admit_naive else ("dense", "exact")
    path = tmp_path / "policy.json"
    save_policy(AdmissionPolicy(model_fingerprint=fingerprint, admitted_modes=modes), path)
    config.kv_transfer_config.kv_connector_extra_config["reuse_policy"] = str(path)
    producer = PrefixProducer(
        utils.create_scheduler, utils.create_model_runner_output, utils.EOS_TOKEN_ID
    )
    producer.store(config, P1 + TASK)
    producer.store(config, P2 + OTHER)
    return config


def _schedule_until_running(scheduler: Scheduler, request: Request) -> SchedulerOutput:
    """Schedule until `request` runs (its lookup is answered off the scheduler loop)."""
    for _ in range(500):
        output = scheduler.schedule()
        if request in scheduler.running:
            return output
        scheduler.update_from_output(output, utils.create_model_runner_output([]))
        time.sleep(0.01)
    raise AssertionError(f"{request.request_id} was never scheduled")


def _new_request(output: SchedulerOutput, request: Request) -> Any:
    return next(r for r in output.scheduled_new_reqs if r.req_id == request.request_id)


def test_approximate_blocks_are_never_reused_saved_or_served_unasked(tmp_path: Path) -> None:
    scheduler = utils.create_scheduler(_engine_config(tmp_path, admit_naive=True))
    asked = _request("asked", PROMPT, GATED)
    scheduler.add_request(asked)
    output = _schedule_until_running(scheduler, asked)
    assert _new_request(output, asked).num_computed_tokens == 80  # P2 exact + the task
    (load,) = output.kv_connector_metadata.loads
    assert (load.start, load.end) == (0, 80)
    assert sum(p.num_tokens for p in load.pieces) == 16  # P2: the exact chain
    # the task, one run per stored chunk, each moved from where P1 put it (Δ = 16 − 32)
    assert (load.spans[0].start, load.spans[-1].end) == (16, 80)
    assert all(a.end == b.start for a, b in itertools.pairwise(load.spans))
    assert {s.delta for s in load.spans} == {16 - 32}
    links = chunk_links(scheduler.connector.fingerprint, PROMPT, BLOCK)
    saves = output.kv_connector_metadata.saves
    assert [s.start for s in saves] == [16, 32, 48, 64]  # computed or moved (P2 was stored)
    assert saves[0].parent_key == off_chain_key(links[0].key)  # off P2's exact link
    assert not {s.key for s in saves} & {link.key for link in links}  # no exact key

    runner_output = utils.create_model_runner_output([asked])
    scheduler.update_from_output(output, runner_output)  # its blocks are in the prefix cache
    manager = scheduler.kv_cache_manager
    req_blocks = manager.get_block_ids(asked.request_id)[0]
    pool = manager.block_pool
    assert pool.blocks[req_blocks[0]].block_hash is not None  # exact: cached, reusable
    later = _request("later", PROMPT, None)
    _, num_hits, _ = manager.get_computed_blocks(later)
    assert num_hits == 16, "vLLM's prefix cache must not serve the approximate blocks"
    assert later.block_hashes[0] == asked.block_hashes[0]
    assert not set(later.block_hashes[1:]) & set(asked.block_hashes[1:])

    # the same tokens without the opt-in: exact reuse only, though the engine admits naive
    scheduler.add_request(later)
    output = _schedule_until_running(scheduler, later)
    assert _new_request(output, later).num_computed_tokens == 16
    assert all(not spec.spans for spec in output.kv_connector_metadata.loads)

    params = scheduler.connector.request_finished(asked, req_blocks)[1]
    assert params == {
        "kvsplice": {
            "reuse": "gated", "admitted": True, "exact_tokens": 16, "approximate_tokens": 64,
        }
    }  # fmt: skip
    assert scheduler.connector.request_finished(later, [])[1] is None  # it asked for nothing
    scheduler.shutdown()


def test_what_a_gated_request_computed_is_found_by_content_and_never_exactly(
    tmp_path: Path,
) -> None:
    """A gated request (P2, the task as P1's agent computed it, then ANSWER it computed)
    is saved by the connector halves; then the same tokens and more: without the opt-in
    only P2 is found (the rest is off-chain), with it ANSWER too, where the task ends
    the runs when nothing past the fence is saved."""
    config = _engine_config(tmp_path, admit_naive=True)
    PrefixProducer(
        utils.create_scheduler, utils.create_model_runner_output, utils.EOS_TOKEN_ID
    ).store(config, P2 + TASK + ANSWER, GATED)
    tokens = P2 + TASK + ANSWER + QUESTION
    for name, params, num_found in (("unasked", None, 16), ("asked", GATED, 16 + 64 + 32)):
        scheduler = utils.create_scheduler(config)
        request = _request(name, tokens, params)
        scheduler.add_request(request)
        output = _schedule_until_running(scheduler, request)
        assert _new_request(output, request).num_computed_tokens == num_found, name
        if params is not None:
            (load,) = output.kv_connector_metadata.loads
            answer_runs = [s for s in load.spans if s.end > 80]
            assert answer_runs and {s.delta for s in answer_runs} == {0}  # stored in place
        scheduler.shutdown()


def test_a_request_without_the_opt_in_never_gets_approximate_kv(tmp_path: Path) -> None:
    config = _engine_config(tmp_path, admit_naive=True)
    for name, params in (("none", None), ("exact", {"kvsplice": {"reuse": "exact"}}),
                         ("malformed", {"kvsplice": {"reuse": "naive"}})):  # fmt: skip
        scheduler = utils.create_scheduler(config)  # each the first to see PROMPT here
        request = _request(name, PROMPT, params)
        scheduler.add_request(request)
        output = _schedule_until_running(scheduler, request)
        assert _new_request(output, request).num_computed_tokens == 16, name
        assert all(not spec.spans for spec in output.kv_connector_metadata.loads), name
        scheduler.shutdown()


def test_gated_is_exact_where_the_policy_does_not_admit_naive(tmp_path: Path) -> None:
    scheduler = utils.create_scheduler(_engine_config(tmp_path, admit_naive=False))
    asked = _request("asked", PROMPT, GATED)
    scheduler.add_request(asked)
    output = _schedule_until_running(scheduler, asked)
    assert _new_request(output, asked).num_computed_tokens == 16
    report = scheduler.connector.request_finished(asked, [])[1]
    assert report is not None and report["kvsplice"]["admitted"] is False
    assert report["kvsplice"]["approximate_tokens"] == 0
    assert "admits no approximate mode" in report["kvsplice"]["reason"]
    scheduler.shutdown()
