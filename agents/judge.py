"""Judge pipelines: N execution agents answer a question, then a judge picks one of them.

Owns the two generation regimes (`progressive`: agent i sees the answers of agents
< i; `parallel`: every agent sees only the question), the execution agents' roles
and graph, `DisplayOrder` (which agent's answer sits in which display slot) and the
judge's template for an order. The wording is `judge_prompts`'; running the calls,
reading the selection and JCR live in the judge workload (eval).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.agents.chat import CHATML, ChatFormat
from kvsplice.agents.graph import AgentGraph, AgentStep, FillRef, QuestionRef, fully_connected
from kvsplice.agents.judge_prompts import DECISION_LINE, JUDGES, MAX_CANDIDATES, check_task
from kvsplice.agents.judge_prompts import execution_personas as _personas
from kvsplice.agents.roles import AgentRole, make_roles
from kvsplice.agents.template import PromptTemplate, agent_current

logger = logging.getLogger(__name__)

REGIMES = ("progressive", "parallel")
MIN_CANDIDATES = 2


def check_regime(regime: str) -> str:
    if regime not in REGIMES:
        raise ValueError(f"regime {regime!r} not in {REGIMES}")
    return regime


def check_num_candidates(num_candidates: int) -> int:
    if not MIN_CANDIDATES <= num_candidates <= MAX_CANDIDATES:
        raise ValueError(
            f"num_candidates {num_candidates} outside [{MIN_CANDIDATES}, {MAX_CANDIDATES}]"
        )
    return num_candidates


def execution_roles(task: str, num_agents: int, max_new_tokens: int) -> list[AgentRole]:
    """Agents "1".."n" of `task`, each in its own voice (persona-first layout)."""
    return make_roles(_personas(task, num_agents), [max_new_tokens] * num_agents)


def execution_graph(roles: Sequence[AgentRole], regime: str) -> AgentGraph:
    """The execution agents' calls in order: one round, answers visible per `regime`."""
    if check_regime(regime) == "progressive":
        return fully_connected(roles)
    steps = []
    for role in roles:
        fills: dict[str, FillRef] = {"user_question": QuestionRef()}
        steps.append(AgentStep(role.for_inputs((), (), roles), 0, fills))
    return AgentGraph("parallel", tuple(steps))


@dataclass(frozen=True)
class DisplayOrder:
    """`agent_ids[k]` is the agent whose answer sits in display slot k; the judge sees the
    slots labelled "Agent 1".."Agent n" in that order and answers with a label."""

    agent_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(set(self.agent_ids)) != len(self.agent_ids):
            raise ValueError(f"agent ids {self.agent_ids} repeat")
        check_num_candidates(len(self.agent_ids))

    @classmethod
    def fixed(cls, agent_ids: Sequence[str]) -> DisplayOrder:
        return cls(tuple(agent_ids))

    @classmethod
    def shuffled(cls, agent_ids: Sequence[str], seed: int, example_id: str) -> DisplayOrder:
        """A permutation drawn per example from (`seed`, `example_id`) alone, so every mode
        (and the dense reference) of one example sees the same one."""
        ids = list(agent_ids)
        random.Random(f"{seed}/{example_id}").shuffle(ids)
        return cls(tuple(ids))

    @property
    def labels(self) -> tuple[str, ...]:
        """The display labels, slot by slot: "1".."n"."""
        return tuple(str(slot + 1) for slot in range(len(self.agent_ids)))

    def agent_at(self, slot: int) -> str:
        """The agent shown in display slot `slot` (0-based)."""
        return self.agent_ids[slot]

    def slot_of_label(self, label: str) -> int | None:
        """The 0-based slot a display label names (None: not a label of this order)."""
        return self.labels.index(label) if label in self.labels else None


def judge_template(task: str, order: DisplayOrder, chat: ChatFormat = CHATML) -> PromptTemplate:
    """System text, the question, one block per slot ("Agent <label>:" + that agent's
    answer), the instruction, then the judge's turn opened with `DECISION_LINE`."""
    wording = JUDGES[check_task(task)]
    blocks = "".join(
        f"Agent {label}:\n{{{agent_current(agent_id)}}}\n\n"
        for label, agent_id in zip(order.labels, order.agent_ids, strict=True)
    )
    text = (
        f"{chat.system_start}{wording.system}{chat.turn_end}\n"
        f"{chat.user_start}Question:\n{{user_question}}\n\n"
        f"{wording.answers_heading}:\n\n{blocks}"
        f"{wording.instruction}{chat.turn_end}\n"
        f"{chat.assistant_start}{DECISION_LINE}"
    )
    return PromptTemplate.parse(text)
