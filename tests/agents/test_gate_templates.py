"""The risk gate on every prompt the package lays out: execution agents are never judge-like
(whatever answers they see), the judges of the judge workload always are."""

from __future__ import annotations

import pytest
from helpers.agents import CharTokenizer

from kvsplice.agents.graph import fully_connected
from kvsplice.agents.judge import DisplayOrder, execution_graph, execution_roles, judge_template
from kvsplice.agents.judge_prompts import TASKS
from kvsplice.agents.layouts import LAYOUTS
from kvsplice.agents.render import render
from kvsplice.agents.roles import code_roles, math_roles, mc_roles, with_layout
from kvsplice.agents.template import PromptTemplate
from kvsplice.client.modes.risk_gate import JudgeVerdict, classify

TOKENIZER = CharTokenizer()


def _verdict(template: PromptTemplate) -> JudgeVerdict:
    values = {
        n: "the question?" if n == "user_question" else "an answer"
        for n in template.placeholder_names
    }
    return classify(render(template, values, TOKENIZER), TOKENIZER.decode)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("roles", [code_roles, math_roles, mc_roles], ids=["code", "math", "mc"])
def test_execution_agents_are_never_judge_like(roles, layout: str) -> None:
    graph = fully_connected(with_layout(roles(5), layout), rounds=2)
    verdicts = [_verdict(step.role.template) for step in graph]
    assert not any(v.judge_like for v in verdicts)
    assert any(v.reason.startswith("answers=9") for v in verdicts)  # they did see answers


@pytest.mark.parametrize("task", TASKS)
def test_the_judge_workload_is_judge_like_and_its_agents_are_not(task: str) -> None:
    for regime in ("progressive", "parallel"):
        for step in execution_graph(execution_roles(task, 4, 8), regime):
            assert not _verdict(step.role.template).judge_like
    verdict = _verdict(judge_template(task, DisplayOrder(("3", "1", "4", "2"))))
    assert verdict == JudgeVerdict(True, "answers=4+selection")
