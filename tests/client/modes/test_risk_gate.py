"""The risk gate's classification: judge-like by declared role, or by answers + a selection instruction."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from helpers.text import CharTokenizer, FakePrompt, make_prompt

from kvsplice.client.modes.risk_gate import classify

TOKENIZER = CharTokenizer(1000, clamp=False)  # code points as ids


def _prompt(*parts: tuple[str, str, str], role: str | None = None) -> FakePrompt:
    """(kind, name, text) parts; one token per character (decoded by `_decode`)."""
    return make_prompt(parts, TOKENIZER, role)


def _decode(ids: Sequence[int]) -> str:
    return TOKENIZER.decode(ids)


def _with_answers(n: int, instruction: str, role: str | None = None) -> FakePrompt:
    parts = [("text", "head", "Question:\n"), ("placeholder", "user_question", "What is 2+2?")]
    for i in range(1, n + 1):
        parts += [("text", f"h{i}", f"\nAgent {i}:\n"), ("placeholder", f"agent_{i}_current", "4")]
    parts.append(("text", "tail", instruction))
    return _prompt(*parts, role=role)


JUDGE_INSTRUCTIONS = (
    "\nCompare the answers. Reply on one line: 'Selected agent id: <id>'",
    "\nChoose the agent whose answer is correct.",
    "\nWhich of the answers is best? Reply with its number.",
    "\nPick the best response among them.",
    "\nSelect one candidate and give its id.",
)
AGENT_INSTRUCTIONS = (
    "\nUsing the answers above, solve the problem step by step.",
    "\nChoose the correct option and end with 'The answer is <letter>.'",
    "\nWrite the complete function.",
    "",
)


@pytest.mark.parametrize("instruction", JUDGE_INSTRUCTIONS)
@pytest.mark.parametrize("num_answers", [2, 4])
def test_answers_followed_by_a_selection_instruction_are_judge_like(
    instruction: str, num_answers: int
) -> None:
    verdict = classify(_with_answers(num_answers, instruction), _decode)
    assert verdict.judge_like
    assert verdict.reason == f"answers={num_answers}+selection"


@pytest.mark.parametrize("instruction", AGENT_INSTRUCTIONS)
def test_answers_without_a_selection_instruction_are_not(instruction: str) -> None:
    verdict = classify(_with_answers(3, instruction), _decode)
    assert not verdict.judge_like
    assert verdict.reason == "answers=3+no-selection"


@pytest.mark.parametrize("instruction", JUDGE_INSTRUCTIONS)
def test_one_answer_is_never_a_comparison(instruction: str) -> None:
    verdict = classify(_with_answers(1, instruction), _decode)
    assert not verdict.judge_like and verdict.reason == "answers=1"


def test_an_instruction_before_the_answers_does_not_count() -> None:
    """Only the text after the last answer is read: a system text saying "select" is not
    an instruction to select among answers the prompt has not shown yet."""
    parts = [("text", "head", "You select the best tool.\n")]
    parts += [("placeholder", f"agent_{i}_current", "ok") for i in (1, 2)]
    parts.append(("text", "tail", "\nContinue the plan."))
    assert not classify(_prompt(*parts), _decode).judge_like


def test_a_declared_role_wins_over_the_structure() -> None:
    judge = _with_answers(0, "\nAnswer.", role="Judge")
    assert classify(judge, _decode).judge_like
    assert classify(judge, _decode).reason == "role=judge"
    solver = _with_answers(4, JUDGE_INSTRUCTIONS[0], role="solver")
    verdict = classify(solver, _decode)
    assert not verdict.judge_like and verdict.reason == "role=solver"


def test_answer_spans_are_agent_placeholders_only() -> None:
    """Text that merely looks like answers (no `agent_*` placeholder) is not counted."""
    parts = [("text", "body", "Agent 1:\n4\nAgent 2:\n5\nSelected agent id: ")]
    verdict = classify(_prompt(*parts), _decode)
    assert not verdict.judge_like and verdict.reason == "answers=0"
