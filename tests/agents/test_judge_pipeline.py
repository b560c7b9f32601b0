"""Judge pipelines: the regimes' graphs and the judge's template for a display order."""

from __future__ import annotations

import pytest

from kvsplice.agents.judge import (
    JUDGE_ID,
    DisplayOrder,
    execution_graph,
    execution_roles,
    judge_pipeline,
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


def _filled(text: str, answers: dict[str, str]) -> str:
    """A template's source text with the question and each speaker's answer written in."""
    text = text.replace("{user_question}", "Q?")
    for speaker, answer in answers.items():
        text = text.replace(f"{{agent_{speaker}_current}}", answer)
    return text


@pytest.mark.parametrize("task", TASKS)
def test_a_transcript_judge_continues_the_agents_chain_in_display_order(task: str) -> None:
    order = DisplayOrder(("3", "1", "4", "2"))
    pipeline = judge_pipeline(task, order, "progressive", 32, "transcript")
    assert pipeline.speakers == {"3": "1", "1": "2", "4": "3", "2": "4"}
    assert [step.agent_id for step in pipeline.graph] == ["1", "2", "3", "4"]
    # the speaker in slot k has the style of the agent displayed there
    styles = {s.agent_id: s.role.name for s in judge_pipeline(task, order, "parallel", 32).graph}
    assert [step.role.name for step in pipeline.graph] == [styles[a] for a in order.agent_ids]
    answers = {label: f"<answer of {label}>" for label in order.labels}
    texts = [_filled(step.role.template.source_text(), answers) for step in pipeline.graph]
    judge = _filled(pipeline.template.source_text(), answers)
    for earlier, later, label in zip(texts, [*texts[1:], judge], order.labels, strict=True):
        assert later.startswith(earlier + answers[label])  # each call extends the last
    assert judge.endswith(DECISION_LINE)
    assert f"Agent {JUDGE_ID} (judge)" in texts[0]  # the roster names the judge from the start


def test_a_persona_first_pipeline_is_the_agents_graph_and_the_quoting_judge() -> None:
    order = DisplayOrder(("2", "1", "3"))
    pipeline = judge_pipeline("gsm8k", order, "progressive", 16)
    assert pipeline.speakers == {"2": "2", "1": "1", "3": "3"}
    assert pipeline.template == judge_template("gsm8k", order)
    expected = execution_graph(execution_roles("gsm8k", 3, 16), "progressive")
    assert [s.role.template for s in pipeline.graph] == [s.role.template for s in expected]


def test_judge_pipelines_check_their_layout_and_agent_ids() -> None:
    with pytest.raises(ValueError, match="judge layout"):
        judge_pipeline("gsm8k", DisplayOrder(("1", "2")), "progressive", 8, "shared-first")
    with pytest.raises(ValueError, match=r"not 1\.\.2"):
        judge_pipeline("gsm8k", DisplayOrder(("1", "3")), "progressive", 8, "transcript")
