"""SmolLM2 end to end: a 3-agent code chain in each approximate mode, measured against dense.

Records per mode the token reuse rate, the share of calls reusing anything,
first-token agreement and KL(dense ‖ mode) of the first-token distribution
(printed; run with -s). Asserts invariants only: outputs, no exception, and
anchor reuse by the third sample (its question nearly repeats the first).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

import pytest
import torch
from helpers.client import store_target as store_target  # fixture
from helpers.modes import one_torch_thread as one_torch_thread  # autouse fixture

from kvsplice.agents.graph import chain
from kvsplice.agents.pipeline import AgentCall, PipelineTrace, run_pipeline
from kvsplice.agents.roles import code_roles
from kvsplice.client.execute.execution import GenerationConfig
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.storeclient.client import StoreClient

logger = logging.getLogger(__name__)

pytestmark = pytest.mark.slow

# Equally long (25 tokens each); the third repeats the first with other names.
QUESTIONS = (
    'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n',
    'def is_even(n: int) -> bool:\n    """Return True if n is even, else False."""\n',
    'def add(x: int, y: int) -> int:\n    """Return the sum of x and y."""\n',
)
MODES = ("anchor", "multicut", "blend", "halo")
MAX_NEW_TOKENS = 8
FIRST_TOKEN = GenerationConfig(max_new_tokens=1)


@dataclass(frozen=True)
class CallFigures:
    sample: int
    agent_id: str
    num_reused_tokens: int
    num_reused_token_layers: int
    num_prompt_tokens: int
    first_token_agrees: bool
    kl_nats: float
    output_ids: tuple[int, ...]


@pytest.fixture(scope="module")
def figures(smollm2: LoadedModel, store_target: str) -> dict[str, list[CallFigures]]:
    reference = DenseLogits(ReuseEngine(smollm2, "dense", None, EngineConfig(store_segments=False)))
    by_mode = {}
    for mode in MODES:
        client = StoreClient(store_target, f"smollm2-approx-{mode}")
        engine = ReuseEngine(smollm2, mode, client, EngineConfig(quant="none"))
        traces = run_samples(engine)
        by_mode[mode] = [
            measure(call, sample, reference)
            for sample, trace in enumerate(traces)
            for call in trace.calls
        ]
        print_mode(mode, by_mode[mode], smollm2.model.config.num_hidden_layers)
    return by_mode


def run_samples(engine: ReuseEngine) -> list[PipelineTrace]:
    graph = chain(code_roles(3))
    return [run_pipeline(graph, q, engine, max_new_tokens=MAX_NEW_TOKENS) for q in QUESTIONS]


class DenseLogits:
    """First-token logits of dense prefill per prompt (modes often share prompts)."""

    def __init__(self, engine: ReuseEngine) -> None:
        self._engine = engine
        self._by_prompt: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, call: AgentCall) -> torch.Tensor:
        ids = call.prompt.token_ids
        if ids not in self._by_prompt:
            self._by_prompt[ids] = self._engine.dense_reference(
                call.prompt, FIRST_TOKEN
            ).logits_first
        return self._by_prompt[ids]


def measure(call: AgentCall, sample: int, reference: DenseLogits) -> CallFigures:
    dense = reference(call)
    kl = torch.nn.functional.kl_div(
        call.logits_first.log_softmax(-1),
        dense.log_softmax(-1),
        log_target=True,
        reduction="sum",
    )
    agrees = int(call.logits_first.argmax()) == int(dense.argmax())
    token_layers = sum(s.num_tokens * s.num_layers for s in call.reused)
    return CallFigures(
        sample, call.agent_id, call.num_reused_tokens, token_layers, call.num_prompt_tokens,
        agrees, float(kl), call.output_ids,
    )  # fmt: skip


def print_mode(mode: str, calls: list[CallFigures], num_layers: int) -> None:
    reused = sum(c.num_reused_tokens for c in calls)
    prompt = sum(c.num_prompt_tokens for c in calls)
    token_layers = sum(c.num_reused_token_layers for c in calls) / (prompt * num_layers)
    print(
        f"\n{mode}: token reuse {reused / prompt:.1%} (token-layers {token_layers:.1%}), "
        f"calls reusing {sum(c.num_reused_tokens > 0 for c in calls)}/{len(calls)}, "
        f"first-token agreement {statistics.mean(c.first_token_agrees for c in calls):.0%}, "
        f"KL(dense‖{mode}) mean {statistics.mean(c.kl_nats for c in calls):.4f} "
        f"max {max(c.kl_nats for c in calls):.4f} nats"
    )
    for c in calls:
        print(
            f"  sample {c.sample} agent {c.agent_id}: reused {c.num_reused_tokens}/"
            f"{c.num_prompt_tokens}, KL {c.kl_nats:.4f}, first token same {c.first_token_agrees}"
        )


def test_every_mode_answers_every_call(figures: dict[str, list[CallFigures]]) -> None:
    for mode in MODES:
        calls = figures[mode]
        assert len(calls) == 3 * len(QUESTIONS)
        assert all(c.output_ids for c in calls), mode
        assert all(torch.isfinite(torch.tensor(c.kl_nats)) and c.kl_nats >= -1e-6 for c in calls)


def test_anchor_reuses_by_the_third_sample(figures: dict[str, list[CallFigures]]) -> None:
    third = [c for c in figures["anchor"] if c.sample == 2]
    exact_system_prompt = [c for c in figures["anchor"] if c.sample == 1]
    # beyond the exact hits of sample 2 (system prompts), sample 3 reuses anchors
    assert sum(c.num_reused_tokens for c in third) > sum(
        c.num_reused_tokens for c in exact_system_prompt
    )


def test_every_mode_reuses_something(figures: dict[str, list[CallFigures]]) -> None:
    for mode in MODES:
        assert sum(c.num_reused_tokens for c in figures[mode]) > 0, mode
