"""Factories for eval tests: call records, a tiny character-level model, a toy workload."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from helpers import text
from helpers.client import make_tiny_llama
from helpers.text import MARKERS
from kvsplice.agents.personas import Persona
from kvsplice.agents.roles import AgentRole, make_roles
from kvsplice.client.model.models import LoadedModel, bundle_model
from kvsplice.eval.measure.metrics import CallRecord
from kvsplice.eval.workloads.workload import Problem

MARKER_BASE = 128


def make_record(**overrides: object) -> CallRecord:
    """A dense call at position 1 with 100 prompt tokens and a 1 s TTFT, unless overridden."""
    base = CallRecord(
        workload="toy", mode="dense", sample_index=0, problem_id="p0", position=1,
        agent_id="1", agent_name="planner", round=0, num_prompt_tokens=100,
        num_reused_tokens=0, num_output_tokens=8, ttft_s=1.0,
    )  # fmt: skip
    return replace(base, **overrides)


class CharTokenizer(text.CharTokenizer):
    """One id per ASCII character; the ChatML markers are ids 128 and 129 (129 is EOS)."""

    def __init__(self) -> None:
        super().__init__(MARKER_BASE)


def use_one_torch_thread() -> None:
    """On the 2-core CI box two intra-op threads fight the store's server thread and
    other tests: one thread runs these small models several times faster, and steadier."""
    torch.set_num_threads(1)


def make_tiny_loaded(seed: int = 0) -> LoadedModel:
    """A 2-layer random Llama (GQA, fp32, eager) over the character vocabulary."""
    vocab_size = MARKER_BASE + len(MARKERS)
    return bundle_model(
        make_tiny_llama(seed=seed, vocab_size=vocab_size, hidden_size=32), CharTokenizer()
    )


@dataclass(frozen=True)
class ToyWorkload:
    """Short questions, short personas; an answer is right when it is non-empty."""

    name: str = "toy"
    ignore_stop: bool = True

    def problems(self, num_problems: int) -> list[Problem]:
        return [
            Problem(f"toy-{i}", f"What is {i} plus {i}?", str(2 * i)) for i in range(num_problems)
        ]

    def roles(self, num_agents: int, max_new_tokens: int) -> list[AgentRole]:
        personas = [
            Persona(f"agent{k}", f"You are agent {k}.", "Answer.") for k in range(num_agents)
        ]
        return make_roles(personas, [max_new_tokens] * num_agents)

    def score(self, problem: Problem, answer_text: str) -> bool | None:
        return bool(answer_text)
