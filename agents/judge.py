"""Judge pipelines: N execution agents answer a question, then a judge picks one of them.

Owns the two generation regimes (`progressive`: agent i sees the answers of agents
< i; `parallel`: every agent sees only the question), the execution agents' roles
and graph, `DisplayOrder` (which agent's answer sits in which display slot), the
judge's template for an order, and the two judge layouts (`JudgePipeline`):
`persona-first` (each execution agent answers under its own system prompt; the judge
gets a prompt of its own that quotes the answers: no candidate sits in an exact chain)
and `transcript` (one group conversation: the agents speak in display order, agent k
as "Agent k", and the judge takes the last turn, so every candidate a progressive
agent gave is part of the judge prompt's exact chain). The wording is
`judge_prompts`'; running the calls, reading the selection and JCR live in the judge
workload (eval).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from kvsplice.agents.chat import CHATML, ChatFormat
from kvsplice.agents.graph import AgentGraph, AgentStep, AnswerRef, FillRef, QuestionRef
from kvsplice.agents.judge_prompts import DECISION_LINE, JUDGES, MAX_CANDIDATES, check_task
from kvsplice.agents.judge_prompts import execution_personas as _personas
from kvsplice.agents.personas import Persona
from kvsplice.agents.roles import AgentRole, make_roles
from kvsplice.agents.template import PromptTemplate, agent_current

logger = logging.getLogger(__name__)

REGIMES = ("progressive", "parallel")
JUDGE_LAYOUTS = ("persona-first", "transcript")
MIN_CANDIDATES = 2
# The judge's id in a transcript (display labels are digits, so it never names a candidate).
JUDGE_ID = "J"


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


def check_judge_layout(layout: str) -> str:
    if layout not in JUDGE_LAYOUTS:
        raise ValueError(f"judge layout {layout!r} not in {JUDGE_LAYOUTS}")
    return layout


def execution_roles(task: str, num_agents: int, max_new_tokens: int) -> list[AgentRole]:
    """Agents "1".."n" of `task`, each in its own voice (persona-first layout)."""
    return make_roles(_personas(task, num_agents), [max_new_tokens] * num_agents)


def execution_graph(
    roles: Sequence[AgentRole], regime: str, roster: Sequence[AgentRole] = ()
) -> AgentGraph:
    """The execution agents' calls in order: one round, answers visible per `regime`.

    `roster`: every agent of the pipeline, for layouts that name them all (default `roles`).
    """
    progressive = check_regime(regime) == "progressive"
    steps = []
    for index, role in enumerate(roles):
        seen = roles[:index] if progressive else ()
        fills: dict[str, FillRef] = {"user_question": QuestionRef()}
        fills.update({agent_current(r.agent_id): AnswerRef(r.agent_id, 0) for r in seen})
        steps.append(AgentStep(role.for_inputs(seen, (), roster or roles), 0, fills))
    return AgentGraph("fully_connected_r1" if progressive else "parallel", tuple(steps))


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


@dataclass(frozen=True)
class JudgePipeline:
    """One example's calls under a display order: the execution agents' `graph`, the judge's
    `template`, and `speakers` (candidate agent id -> the id its execution agent has in the
    graph and in the judge's placeholders: itself persona-first, its display label in a
    transcript)."""

    graph: AgentGraph
    template: PromptTemplate
    speakers: Mapping[str, str]

    def agent_of(self, speaker: str) -> str:
        """The candidate agent id a speaker id stands for."""
        for agent, spoken in self.speakers.items():
            if spoken == speaker:
                return agent
        raise KeyError(f"no candidate speaks as {speaker!r}")


def judge_pipeline(
    task: str,
    order: DisplayOrder,
    regime: str,
    max_new_tokens: int,
    layout: str = "persona-first",
    chat: ChatFormat = CHATML,
) -> JudgePipeline:
    """The execution agents and the judge of `task` for `order` in `layout` (module docstring).

    Candidate agent ids are "1".."n" (agent i answers in the i-th style)."""
    ids = order.agent_ids
    if sorted(ids, key=int) != [str(i) for i in range(1, len(ids) + 1)]:
        raise ValueError(f"candidate agent ids {ids} are not 1..{len(ids)}")
    roles = execution_roles(task, len(ids), max_new_tokens)
    if check_judge_layout(layout) == "persona-first":
        graph = execution_graph(roles, regime)
        return JudgePipeline(graph, judge_template(task, order, chat), {a: a for a in ids})
    by_agent = {r.agent_id: r for r in roles}
    speaking = [
        replace(by_agent[agent], agent_id=label, layout="transcript")
        for label, agent in zip(order.labels, ids, strict=True)
    ]
    wording = JUDGES[task]
    judge = AgentRole(
        JUDGE_ID, "judge", roles[0].template, 1,
        Persona("judge", wording.system, wording.instruction), chat, "transcript",
    )  # fmt: skip
    roster = (*speaking, judge)
    graph = execution_graph(speaking, regime, roster)
    turn = judge.for_inputs(speaking, (), roster).template.source_text()
    speakers = dict(zip(ids, order.labels, strict=True))
    return JudgePipeline(graph, PromptTemplate.parse(turn + DECISION_LINE), speakers)
