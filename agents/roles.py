"""Agents and the role sets of the three workloads (code, math, multiple choice).

Owns `AgentRole` (a persona with an id, a template, an output cap and a prompt
layout) and `code_roles`/`math_roles`/`mc_roles`. Which answers an agent sees is
`graph`'s job; where they go in the prompt is `layouts`'; the wording `personas`'.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvsplice.agents import personas
from kvsplice.agents.chat import CHATML, ChatFormat
from kvsplice.agents.layouts import DEFAULT_LAYOUT, Layout, check_layout, lay_out, persona_template
from kvsplice.agents.personas import Persona
from kvsplice.agents.template import PromptTemplate

logger = logging.getLogger(__name__)

MIN_AGENTS, MAX_AGENTS = 2, 5


@dataclass(frozen=True)
class AgentRole:
    """One agent. `persona`, when set, lets a graph re-lay the template for its inputs."""

    agent_id: str
    name: str
    template: PromptTemplate
    max_new_tokens: int
    persona: Persona | None = None
    chat: ChatFormat = CHATML
    layout: Layout = DEFAULT_LAYOUT

    def __post_init__(self) -> None:
        check_layout(self.layout)
        if not self.agent_id.isalnum():
            raise ValueError(f"agent_id {self.agent_id!r} must be alphanumeric")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} must be positive")

    def for_inputs(
        self,
        current: Sequence[AgentRole],
        history: Sequence[AgentRole],
        roster: Sequence[AgentRole] = (),
    ) -> AgentRole:
        """This role with a template showing `current` answers and previous-round `history`,
        laid out by `self.layout`; `roster` is every agent of the pipeline (default: this one).

        Without a persona the template is kept as written (the graph checks it).
        """
        if self.persona is None:
            return self
        template = lay_out(self.layout, self, current, history, roster or (self,), self.chat)
        return replace(self, template=template)


def make_roles(
    personas: Sequence[Persona], max_new_tokens: Sequence[int], chat: ChatFormat = CHATML
) -> list[AgentRole]:
    """Roles with ids "1".."n" in order, each laid out to see only the question."""
    if len(personas) != len(max_new_tokens):
        raise ValueError(f"{len(personas)} personas but {len(max_new_tokens)} output caps")
    return [
        AgentRole(str(i), p.title, persona_template(p, chat=chat), cap, p, chat)
        for i, (p, cap) in enumerate(zip(personas, max_new_tokens, strict=True), start=1)
    ]


def pick_personas(num_agents: int, workers: Sequence[Persona], final: Persona) -> list[Persona]:
    """The first `num_agents - 1` workers, then the final decider."""
    if not MIN_AGENTS <= num_agents <= MAX_AGENTS:
        raise ValueError(f"num_agents {num_agents} outside [{MIN_AGENTS}, {MAX_AGENTS}]")
    if num_agents - 1 > len(workers):
        raise ValueError(
            f"num_agents {num_agents} needs {num_agents - 1} workers, have {len(workers)}"
        )
    return [*workers[: num_agents - 1], final]


def code_roles(
    num_agents: int, max_new_tokens: int = 96, final_max_new_tokens: int = 160
) -> list[AgentRole]:
    """HumanEval agents: planner, coder, tester, reviewer (first n−1), then the final coder."""
    chosen = pick_personas(num_agents, personas.CODE_WORKERS, personas.CODE_FINAL)
    return make_roles(chosen, _caps(num_agents, max_new_tokens, final_max_new_tokens))


def math_roles(
    num_agents: int, max_new_tokens: int = 96, final_max_new_tokens: int = 64
) -> list[AgentRole]:
    """GSM8K-style agents: analyst, solver, second solver, verifier, then the final answer."""
    chosen = pick_personas(num_agents, personas.MATH_WORKERS, personas.MATH_FINAL)
    return make_roles(chosen, _caps(num_agents, max_new_tokens, final_max_new_tokens))


def mc_roles(
    num_agents: int, max_new_tokens: int = 64, final_max_new_tokens: int = 4
) -> list[AgentRole]:
    """MMLU-style agents: expert, eliminator, fact checker, critic, then the judge (a letter)."""
    chosen = pick_personas(num_agents, personas.MC_WORKERS, personas.MC_FINAL)
    return make_roles(chosen, _caps(num_agents, max_new_tokens, final_max_new_tokens))


def _caps(num_agents: int, worker_cap: int, final_cap: int) -> list[int]:
    return [worker_cap] * (num_agents - 1) + [final_cap]


def with_layout(roles: Sequence[AgentRole], layout: str) -> list[AgentRole]:
    """`roles` laid out by `layout` (one of `layouts.LAYOUTS`) from their next `for_inputs`."""
    return [replace(role, layout=check_layout(layout)) for role in roles]
