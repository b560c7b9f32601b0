"""What every workload provides: its problems, its agents, how an answer is scored, its candidates.

Owns `Problem` and the `Workload` protocol. Loading and
scoring live in one module per workload; running agents on problems is
`bench.mode_runner`'s job. A candidate block is a span of a call's prompt that
holds one candidate answer (`client.modes.base.candidate_blocks`: its agent-output
placeholders); a workload whose final call weighs candidates (a judge) runs
each problem once per display order (`orders`), the others in one order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvsplice.agents.roles import AgentRole
from kvsplice.client.modes.base import CandidateBlock, candidate_blocks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Problem:
    """One question: the text that fills `{user_question}` and what a right answer is.

    `reference` is the expected answer in the workload's terms (a number, a
    letter) or None when only `extras` can judge it (HumanEval's tests) or
    nothing can (synthetic text).
    """

    problem_id: str
    question: str
    reference: str | None = None
    extras: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.problem_id:
            raise ValueError("problem_id must be non-empty")
        if not self.question:
            raise ValueError(f"problem {self.problem_id!r} has an empty question")


class Workload(Protocol):
    """A task the agent pipeline runs: problems, roles, a scorer, and its candidates' orders.

    Workloads subclass it to inherit `orders` (one order: the candidates as given).
    """

    @property
    def name(self) -> str: ...

    @property
    def ignore_stop(self) -> bool:
        """True when every agent must generate exactly its cap (fixed-shape benchmarks)."""
        ...

    def problems(self, num_problems: int) -> list[Problem]: ...

    def roles(self, num_agents: int, max_new_tokens: int) -> list[AgentRole]: ...

    def score(self, problem: Problem, answer_text: str) -> bool | None:
        """Whether `answer_text` (the final agent's output) is right; None if unscorable."""
        ...

    def orders(self, problem: Problem, candidate_ids: Sequence[str]) -> tuple[tuple[str, ...], ...]:
        """The display orders (permutations of `candidate_ids`) to run `problem` in; the first
        is the fixed order. Workloads without candidates run the one order given."""
        return (tuple(candidate_ids),)


__all__ = ["CandidateBlock", "Problem", "Workload", "candidate_blocks"]
