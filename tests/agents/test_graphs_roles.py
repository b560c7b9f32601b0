"""Role sets and graphs: execution order and what fills each placeholder."""

from __future__ import annotations

import pytest

from kvsplice.agents.graph import (
    AgentGraph,
    AgentStep,
    AnswerRef,
    QuestionRef,
    chain,
    fully_connected,
)
from kvsplice.agents.roles import AgentRole, code_roles, math_roles, mc_roles
from kvsplice.agents.template import PromptTemplate

ROLE_SETS = (code_roles, math_roles, mc_roles)


@pytest.mark.parametrize("make_roles", ROLE_SETS)
@pytest.mark.parametrize("num_agents", [2, 3, 4, 5])
def test_role_sets_have_ids_1_to_n_and_a_final_decider(make_roles, num_agents: int) -> None:
    roles = make_roles(num_agents)
    assert [r.agent_id for r in roles] == [str(i) for i in range(1, num_agents + 1)]
    assert len({r.name for r in roles}) == num_agents
    assert roles[-1].name in ("final coder", "final answer", "judge")
    for role in roles:
        assert role.template.placeholder_names == ("user_question",)
        assert role.template.source_text().startswith("<|im_start|>system\n")
        assert role.template.source_text().endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("make_roles", ROLE_SETS)
@pytest.mark.parametrize("num_agents", [1, 6])
def test_role_sets_refuse_other_sizes(make_roles, num_agents: int) -> None:
    with pytest.raises(ValueError, match="num_agents"):
        make_roles(num_agents)


def test_mc_judge_answers_with_a_letter_in_few_tokens() -> None:
    judge = mc_roles(3)[-1]
    assert judge.max_new_tokens <= 8
    assert "A, B, C or D" in judge.template.source_text()


@pytest.mark.parametrize("num_agents", [2, 3, 4, 5])
def test_chain_feeds_each_agent_the_previous_answer(num_agents: int) -> None:
    graph = chain(code_roles(num_agents))
    assert [(s.agent_id, s.round) for s in graph] == [(str(i), 0) for i in range(1, num_agents + 1)]
    assert graph.steps[0].fills == {"user_question": QuestionRef()}
    for index, step in enumerate(graph.steps[1:], start=1):
        previous = str(index)
        assert step.fills == {
            "user_question": QuestionRef(),
            f"agent_{previous}_current": AnswerRef(previous, 0),
        }
        assert step.role.template.placeholder_names == (
            "user_question",
            f"agent_{previous}_current",
        )
    assert graph.final_step.agent_id == str(num_agents)


@pytest.mark.parametrize("num_agents", [2, 3, 4, 5])
def test_fully_connected_two_rounds(num_agents: int) -> None:
    graph = fully_connected(math_roles(num_agents), rounds=2)
    ids = [str(i) for i in range(1, num_agents + 1)]
    assert [(s.agent_id, s.round) for s in graph] == [(i, r) for r in (0, 1) for i in ids]
    for step in graph:
        position = ids.index(step.agent_id)
        expected = {"user_question": QuestionRef()}
        expected.update({f"agent_{j}_current": AnswerRef(j, step.round) for j in ids[:position]})
        if step.round == 1:
            expected.update({f"agent_{j}_history_-1": AnswerRef(j, 0) for j in ids})
        assert step.fills == expected
        assert set(step.role.template.placeholder_names) == set(expected)
    assert (graph.final_step.agent_id, graph.final_step.round) == (ids[-1], 1)


def test_hand_written_template_keeps_its_own_placeholders() -> None:
    template = PromptTemplate.parse("Q {user_question} A1 {agent_1_current}")
    roles = [
        AgentRole("1", "a", PromptTemplate.parse("Q {user_question}"), 8),
        AgentRole("2", "b", PromptTemplate.parse("Q {user_question}"), 8),
        AgentRole("3", "c", template, 8),
    ]
    step = fully_connected(roles, rounds=1).steps[2]
    assert step.role.template == template
    assert step.fills == {"user_question": QuestionRef(), "agent_1_current": AnswerRef("1", 0)}


def test_graph_rejects_unfillable_templates_and_reads_before_writes() -> None:
    role = AgentRole("1", "a", PromptTemplate.parse("{agent_2_current}"), 8)
    with pytest.raises(ValueError, match="nothing fills"):
        chain([role])
    step = AgentStep(role, 0, {"agent_2_current": AnswerRef("2", 0)})
    with pytest.raises(ValueError, match="before it exists"):
        AgentGraph("bad", (step,))
    with pytest.raises(ValueError, match="unique"):
        chain([code_roles(2)[0], code_roles(2)[0]])
