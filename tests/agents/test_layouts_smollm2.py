"""SmolLM2, 5 agents, every prompt layout: exact reuse is dense, and the transcript pays."""

from __future__ import annotations

import itertools

import pytest
from helpers.client import store_target as store_target  # fixture

from kvsplice.agents.graph import fully_connected
from kvsplice.agents.layouts import LAYOUTS
from kvsplice.agents.pipeline import AgentCall, run_pipeline
from kvsplice.agents.roles import code_roles, with_layout
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.storeclient.client import StoreClient

pytestmark = pytest.mark.slow

QUESTIONS = (
    'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n',
    'def is_even(n: int) -> bool:\n    """Return True if n is even."""\n',
)
MAX_NEW_TOKENS = 6


def run_calls(loaded: LoadedModel, layout: str, engine: ReuseEngine) -> list[AgentCall]:
    graph = fully_connected(with_layout(code_roles(5), layout))
    traces = [run_pipeline(graph, q, engine, max_new_tokens=MAX_NEW_TOKENS) for q in QUESTIONS]
    return [call for trace in traces for call in trace.calls]


@pytest.fixture(scope="module")
def calls_by_layout(
    smollm2: LoadedModel, store_target: str
) -> dict[str, dict[str, list[AgentCall]]]:
    runs: dict[str, dict[str, list[AgentCall]]] = {}
    for layout in LAYOUTS:
        dense = run_calls(smollm2, layout, ReuseEngine(smollm2, "dense"))
        client = StoreClient(store_target, f"layouts-{layout}")
        with ReuseEngine(smollm2, "exact", client, EngineConfig(quant="none")) as engine:
            exact = run_calls(smollm2, layout, engine)
        client.close()
        runs[layout] = {"dense": dense, "exact": exact}
    return runs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_exact_equals_dense_in_every_layout(
    calls_by_layout: dict[str, dict[str, list[AgentCall]]], layout: str
) -> None:
    dense, exact = calls_by_layout[layout]["dense"], calls_by_layout[layout]["exact"]
    assert [c.prompt.token_ids for c in exact] == [c.prompt.token_ids for c in dense]
    assert [c.output_ids for c in exact] == [c.output_ids for c in dense]
    for reused, reference in zip(exact, dense, strict=True):
        diff = (reused.logits_first - reference.logits_first).abs().max()
        assert float(diff) <= 1e-3


def test_transcript_agent_prefills_only_its_own_turn(
    calls_by_layout: dict[str, dict[str, list[AgentCall]]],
) -> None:
    exact = calls_by_layout["transcript"]["exact"]
    for previous, call in itertools.pairwise(exact):
        if call.agent_id == "1":  # a new question: the shared preamble is the hit
            assert call.num_reused_tokens >= call.prompt.spans[0].num_tokens
            continue
        # everything the previous agent saw and said is an exact hit
        assert call.num_reused_tokens >= previous.num_prompt_tokens + len(previous.output_ids)
        assert all(span.exact and span.mode == "exact" for span in call.reused)


def test_layouts_differ_in_reuse_not_in_fidelity(
    calls_by_layout: dict[str, dict[str, list[AgentCall]]],
) -> None:
    def reuse(layout: str) -> float:
        calls = calls_by_layout[layout]["exact"]
        return sum(c.num_reused_tokens for c in calls) / sum(c.num_prompt_tokens for c in calls)

    assert reuse("persona-first") < reuse("shared-first") < reuse("transcript")
    assert reuse("transcript") >= 0.8
