"""run_pipeline on a tiny random Llama: trace shape, answers passed as ids, exact ≡ dense."""

from __future__ import annotations

import pytest
from helpers.agents import MARKER_BASE, make_tiny_loaded
from helpers.client import store_target as store_target  # fixture

from kvsplice.agents.graph import chain, fully_connected
from kvsplice.agents.pipeline import AgentCall, run_pipeline, stop_token_ids
from kvsplice.agents.roles import math_roles
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.storeclient.client import StoreClient

QUESTION = "Tom has 3 apples and buys 4 more. How many?"


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return make_tiny_loaded()


def test_stop_tokens_are_eos_and_the_turn_end_marker(loaded: LoadedModel) -> None:
    assert stop_token_ids(loaded.tokenizer, "<|im_end|>") == (MARKER_BASE + 1,)


def test_chain_trace_passes_answers_as_ids(loaded: LoadedModel) -> None:
    seen: list[AgentCall] = []
    trace = run_pipeline(
        chain(math_roles(3)),
        QUESTION,
        ReuseEngine(loaded, "dense"),
        max_new_tokens=5,
        on_call=seen.append,
    )
    assert [c.agent_id for c in trace.calls] == ["1", "2", "3"] and seen == trace.calls
    for previous, call in zip(trace.calls, trace.calls[1:], strict=False):
        span = call.prompt.span_named(f"agent_{previous.agent_id}_current")
        expected = previous.output_ids
        assert (span is None) == (not expected)
        assert span is None or call.prompt.span_ids(span) == expected
    for call in trace.calls:
        assert call.mode == "dense" and call.num_reused_tokens == 0 and call.ttft_s > 0
        assert call.logits_first.shape == (MARKER_BASE + 2,)
        assert len(call.output_ids) <= 5 and call.timings.prefill_s > 0
    assert trace.final_answer == trace.calls[-1].text


def test_ignore_stop_generates_exactly_the_cap(loaded: LoadedModel) -> None:
    trace = run_pipeline(
        chain(math_roles(2)),
        QUESTION,
        ReuseEngine(loaded, "dense"),
        max_new_tokens=4,
        ignore_stop=True,
    )
    assert all(len(call.output_ids) == 4 for call in trace.calls)


@pytest.mark.parametrize("mode", ["exact", "naive"])
def test_fully_connected_rounds_reuse_across_calls(
    loaded: LoadedModel, store_target: str, mode: str
) -> None:
    with (
        StoreClient(store_target, f"pipeline-{mode}") as client,
        ReuseEngine(loaded, mode, client, EngineConfig(quant="none")) as engine,
    ):
        trace = run_pipeline(
            fully_connected(math_roles(2), rounds=2),
            QUESTION,
            engine,
            max_new_tokens=4,
            ignore_stop=True,
        )
        references = [engine.dense_reference(c.prompt, c.generation) for c in trace.calls]
    assert [(c.agent_id, c.round) for c in trace.calls] == [("1", 0), ("2", 0), ("1", 1), ("2", 1)]
    for call, reference in zip(trace.calls, references, strict=True):
        if mode == "exact":
            assert call.output_ids == reference.output_ids
    # Round 1 re-reads the system prompt and question agent 1 stored in round 0.
    assert trace.calls[2].num_reused_tokens > 0
