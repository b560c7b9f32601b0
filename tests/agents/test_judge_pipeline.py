"""Judge pipelines: the regimes' graphs and the judge's template for a display order."""

from __future__ import annotations

import pytest

from kvsplice.agents.judge import (
    DisplayOrder,
    execution_graph,
    execution_roles,
    judge_template,
)
from kvsplice.agents.judge_prompts import DECISION_LINE, MAX_CANDIDATES, TASKS


@pytest.mark.parametrize("task", TASKS)
def test_progressive_agents_see_earlier_answers_and_parallel_ones_only_the_question(
    task: str,
) -> None:
    roles = execution_roles(task, 4, 32)
    progressive = execution_graph(roles, "progressive")
    for index, step in enumerate(progressive):
        answers = [n for n in step.role.template.placeholder_names if n.startswith("agent_")]
        assert answers == [f"agent_{i}_current" for i in range(1, index + 1)]
    for step in execution_graph(roles, "parallel"):
        assert step.role.template.placeholder_names == ("user_question",)
    systems = {step.role.template.parts[0] for step in execution_graph(roles, "parallel")}
    assert len(systems) == 4  # distinct voices, or greedy agents would all answer alike


@pytest.mark.parametrize("task", TASKS)
def test_judge_template_shows_each_slot_label_with_the_agent_placed_there(task: str) -> None:
    order = DisplayOrder(("3", "1", "4", "2"))
    text = judge_template(task, order).source_text()
    positions = [text.index(f"Agent {label}:\n{{agent_{agent}_current}}")
                 for label, agent in zip(order.labels, order.agent_ids, strict=True)]  # fmt: skip
    assert positions == sorted(positions)
    assert text.endswith(DECISION_LINE)
    assert text.count("Agent ") == 4


def test_fixed_and_shuffled_templates_differ_only_in_which_answer_fills_a_slot() -> None:
    fixed = judge_template("gsm8k", DisplayOrder.fixed(("1", "2", "3")))
    shuffled = judge_template("gsm8k", DisplayOrder(("2", "3", "1")))
    renamed = shuffled.source_text()
    for old, new in (("agent_2", "X1"), ("agent_3", "X2"), ("agent_1", "X3")):
        renamed = renamed.replace(old, new)
    for new, old in (("X1", "agent_1"), ("X2", "agent_2"), ("X3", "agent_3")):
        renamed = renamed.replace(new, old)
    assert renamed == fixed.source_text()


def test_candidate_counts_and_regimes_are_checked() -> None:
    with pytest.raises(ValueError, match="num_candidates"):
        DisplayOrder(("1",))
    with pytest.raises(ValueError, match="num_agents"):
        execution_roles("gsm8k", MAX_CANDIDATES + 1, 8)
    with pytest.raises(ValueError, match="regime"):
        execution_graph(execution_roles("mmlu", 2, 8), "debate")
    with pytest.raises(ValueError, match="task"):
        judge_template("math", DisplayOrder(("1", "2")))
