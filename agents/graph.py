"""Agent graphs: the order in which agents run and what fills each placeholder.

Owns `AgentGraph` (a static list of `AgentStep`s), `chain` and
`fully_connected`. Fills are references (the question, or an agent's answer in
a round), resolved by `pipeline` as answers arrive; nothing here runs a model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvsplice.agents.roles import AgentRole
from kvsplice.agents.template import agent_current, agent_history

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuestionRef:
    """The user's question."""


@dataclass(frozen=True)
class AnswerRef:
    """The answer `agent_id` gave in round `round`."""

    agent_id: str
    round: int


FillRef = QuestionRef | AnswerRef


@dataclass(frozen=True)
class AgentStep:
    """One agent call: the role (template laid out for this call), its round, its fills."""

    role: AgentRole
    round: int
    fills: Mapping[str, FillRef]

    def __post_init__(self) -> None:
        names = set(self.role.template.placeholder_names)
        missing = names - set(self.fills)
        if missing:
            raise ValueError(f"agent {self.role.agent_id}: nothing fills {sorted(missing)}")

    @property
    def agent_id(self) -> str:
        return self.role.agent_id


@dataclass(frozen=True)
class AgentGraph:
    """Steps in execution order; the last step's answer is the pipeline's answer."""

    name: str
    steps: tuple[AgentStep, ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError(f"graph {self.name!r} has no steps")
        done: set[tuple[str, int]] = set()
        for step in self.steps:
            for ref in step.fills.values():
                if isinstance(ref, AnswerRef) and (ref.agent_id, ref.round) not in done:
                    raise ValueError(
                        f"step {step.agent_id}@{step.round} reads {ref} before it exists"
                    )
            done.add((step.agent_id, step.round))

    def __iter__(self) -> Iterator[AgentStep]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def final_step(self) -> AgentStep:
        return self.steps[-1]


def chain(roles: Sequence[AgentRole]) -> AgentGraph:
    """Agent i sees the question and agent i−1's answer; one round."""
    _check_roles(roles)
    steps = []
    for index, role in enumerate(roles):
        previous = roles[index - 1 : index]
        fills: dict[str, FillRef] = {"user_question": QuestionRef()}
        fills.update({agent_current(p.agent_id): AnswerRef(p.agent_id, 0) for p in previous})
        steps.append(_step(role.for_inputs(previous, (), roles), 0, fills))
    return AgentGraph("chain", tuple(steps))


def fully_connected(roles: Sequence[AgentRole], rounds: int = 1) -> AgentGraph:
    """Every agent runs every round, seeing this round's answers of the agents before
    it and the previous round's answers of all agents (itself included); KVComm's setting.
    """
    _check_roles(roles)
    if rounds < 1:
        raise ValueError(f"rounds {rounds} must be >= 1")
    steps = []
    for round_index in range(rounds):
        history = list(roles) if round_index > 0 else []
        for index, role in enumerate(roles):
            current = roles[:index]
            fills: dict[str, FillRef] = {"user_question": QuestionRef()}
            fills.update(
                {agent_current(r.agent_id): AnswerRef(r.agent_id, round_index) for r in current}
            )
            fills.update(
                {
                    agent_history(r.agent_id, -1): AnswerRef(r.agent_id, round_index - 1)
                    for r in history
                }
            )
            steps.append(_step(role.for_inputs(current, history, roles), round_index, fills))
    return AgentGraph(f"fully_connected_r{rounds}", tuple(steps))


def _step(role: AgentRole, round_index: int, fills: dict[str, FillRef]) -> AgentStep:
    # A hand-written template may use only some of the available answers.
    used = set(role.template.placeholder_names)
    return AgentStep(role, round_index, {k: v for k, v in fills.items() if k in used})


def _check_roles(roles: Sequence[AgentRole]) -> None:
    if not roles:
        raise ValueError("a graph needs at least one role")
    ids = [r.agent_id for r in roles]
    if len(set(ids)) != len(ids):
        raise ValueError(f"agent ids {ids} are not unique")
