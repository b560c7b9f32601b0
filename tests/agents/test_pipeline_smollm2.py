"""SmolLM2 end to end: a 3-agent code chain in modes dense, exact and naive with a real store."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.client import store_target as store_target  # fixture

from kvsplice.agents.graph import chain
from kvsplice.agents.pipeline import AgentCall, PipelineTrace, run_pipeline
from kvsplice.agents.roles import code_roles
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

logger = logging.getLogger(__name__)

pytestmark = pytest.mark.slow

QUESTIONS = (
    'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n',
    'def is_even(n: int) -> bool:\n    """Return True if n is even."""\n',
)
MAX_NEW_TOKENS = 8


def run_mode(loaded: LoadedModel, mode: str, store: StoreClient | None) -> list[PipelineTrace]:
    engine = ReuseEngine(loaded, mode, store, EngineConfig(quant="none"))
    graph = chain(code_roles(3))
    return [run_pipeline(graph, q, engine, max_new_tokens=MAX_NEW_TOKENS) for q in QUESTIONS]


@pytest.fixture(scope="module")
def dense_traces(smollm2: LoadedModel) -> list[PipelineTrace]:
    return run_mode(smollm2, "dense", None)


@pytest.fixture(scope="module")
def exact_traces(smollm2: LoadedModel, store_target: str) -> list[PipelineTrace]:
    return run_mode(smollm2, "exact", StoreClient(store_target, "smollm2-exact"))


def outputs(traces: list[PipelineTrace]) -> list[tuple[int, ...]]:
    return [call.output_ids for trace in traces for call in trace.calls]


def calls(traces: list[PipelineTrace]) -> list[AgentCall]:
    return [call for trace in traces for call in trace.calls]


def test_exact_mode_equals_dense_and_hits_cached_prompts(
    exact_traces: list[PipelineTrace], dense_traces: list[PipelineTrace]
) -> None:
    assert outputs(exact_traces) == outputs(dense_traces)
    for exact_call, dense_call in zip(calls(exact_traces), calls(dense_traces), strict=True):
        assert exact_call.prompt.token_ids == dense_call.prompt.token_ids
        gap = (exact_call.logits_first - dense_call.logits_first).abs().max()
        assert gap <= 1e-3, f"agent {exact_call.agent_id}: max |Δlogit| {gap}"
    assert all(call.num_reused_tokens > 0 for call in exact_traces[1].calls)


def test_naive_reuses_more_than_exact_and_records_drift(
    smollm2: LoadedModel,
    store_target: str,
    exact_traces: list[PipelineTrace],
    dense_traces: list[PipelineTrace],
) -> None:
    naive = run_mode(smollm2, "naive", StoreClient(store_target, "smollm2-naive"))
    assert sum(c.num_reused_tokens for c in calls(naive)) > sum(
        c.num_reused_tokens for c in calls(exact_traces)
    )
    engine = ReuseEngine(smollm2, "dense")
    for call, dense_call in zip(calls(naive), calls(dense_traces), strict=True):
        same_prompt = call.prompt.token_ids == dense_call.prompt.token_ids
        reference = (
            dense_call if same_prompt else engine.dense_reference(call.prompt, call.generation)
        )
        reference_logits = reference.logits_first
        kl = torch.nn.functional.kl_div(
            call.logits_first.log_softmax(-1),
            reference_logits.log_softmax(-1),
            log_target=True,
            reduction="sum",
        )
        assert torch.isfinite(kl) and kl >= 0
        logger.info(
            "naive agent %s: reuse %.0f%%, KL(dense||naive) %.4f, same first token %s, same output %s",
            call.agent_id, 100 * call.reuse_rate, float(kl),
            int(call.logits_first.argmax()) == int(reference_logits.argmax()),
            call.output_ids == reference.output_ids,
        )  # fmt: skip


def test_unreachable_store_gives_dense_outputs(
    smollm2: LoadedModel, dense_traces: list[PipelineTrace]
) -> None:
    config = StoreClientConfig(
        lookup_timeout_s=0.05, get_timeout_s=0.05, put_timeout_s=0.05, max_attempts=1
    )
    dead = StoreClient("127.0.0.1:1", "smollm2-dead", config=config)
    engine = ReuseEngine(smollm2, "naive", dead, EngineConfig(quant="none"))
    trace = run_pipeline(chain(code_roles(3)), QUESTIONS[0], engine, max_new_tokens=MAX_NEW_TOKENS)
    assert outputs([trace]) == outputs(dense_traces[:1])
    assert all(call.num_reused_tokens == 0 for call in trace.calls)
