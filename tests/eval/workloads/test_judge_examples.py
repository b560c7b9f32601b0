"""The `--data` format of `bench judge`, the shipped sample, and checking candidates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsplice.eval.workloads.judge_examples import (
    JUDGE_SAMPLE,
    JudgeExample,
    is_correct,
    load_judge_data,
    task_examples,
)


def write(path: Path, *records: object) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_shipped_sample_mixes_the_three_tasks() -> None:
    examples = load_judge_data(JUDGE_SAMPLE)
    assert {e.task for e in examples} == {"gsm8k", "mmlu", "humaneval"}
    assert all(e.candidates is not None and len(e.candidates) == 4 for e in examples)
    # every candidate set has a right and a wrong answer where it can be checked
    for example in examples:
        assert example.candidates is not None
        checks = {is_correct(example, c) for c in example.candidates}
        assert checks == ({None} if example.task == "humaneval" else {True, False})


def test_a_record_parses_with_or_without_an_answer(tmp_path: Path) -> None:
    path = write(
        tmp_path / "d.jsonl",
        {"id": "a", "task": "gsm8k", "question": "1+1?", "candidates": ["2", "3"], "answer": "2"},
        {"id": "b", "task": "mmlu", "question": "Pick\nA. x\nB. y", "candidates": ["A", "B", "A"]},
    )
    first, second = load_judge_data(path)
    assert first == JudgeExample("a", "gsm8k", "1+1?", ("2", "3"), "2")
    assert second.reference is None and is_correct(second, "The answer is A.") is None


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"id": "a", "task": "math", "question": "q", "candidates": ["1", "2"]}, "task"),
        ({"id": "a", "task": "gsm8k", "question": "q", "candidates": ["1"]}, "candidates"),
        ({"id": "a", "task": "gsm8k", "question": "q", "candidates": ["1"] * 9}, "candidates"),
        ({"id": "a", "task": "gsm8k", "question": "q", "candidates": ["1", ""]}, "non-empty"),
        ({"id": "a", "task": "gsm8k", "question": "q"}, "candidates"),
        ({"id": "a", "task": "gsm8k", "question": "q", "candidates": ["1", "2"], "x": 1}, "unknown"),
        ({"id": "a", "task": "gsm8k", "question": "q", "candidates": ["1", "2"], "answer": 2}, "answer"),
    ],
)  # fmt: skip
def test_malformed_records_name_their_line(tmp_path: Path, record: dict, message: str) -> None:
    path = write(tmp_path / "bad.jsonl", record)
    with pytest.raises(ValueError, match=message) as error:
        load_judge_data(path)
    assert "record 1" in str(error.value)


def test_repeated_ids_are_refused(tmp_path: Path) -> None:
    record = {"id": "a", "task": "gsm8k", "question": "q", "candidates": ["1", "2"]}
    with pytest.raises(ValueError, match="repeat"):
        load_judge_data(write(tmp_path / "d.jsonl", record, record))


def test_task_examples_come_from_the_task_samples() -> None:
    (math,) = task_examples("gsm8k", 1)
    (mc,) = task_examples("mmlu", 1)
    assert math.candidates is None and math.reference is not None
    assert mc.reference in "ABCD" and "\nA. " in mc.question


def test_humaneval_candidate_sets_given_as_data_are_checked_by_the_problems_tests(
    tmp_path: Path,
) -> None:
    right = "```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```"
    wrong = "```python\ndef truncate_number(number: float) -> float:\n    return number\n```"
    path = write(
        tmp_path / "he.jsonl",
        {"id": "HumanEval/2", "task": "humaneval", "question": "q", "candidates": [right, wrong]},
        {"id": "own-1", "task": "humaneval", "question": "q", "candidates": [right, wrong]},
    )
    known, own = load_judge_data(path)
    assert [is_correct(known, c) for c in (right, wrong)] == [True, False]
    # an id that names no HumanEval problem has nothing to be checked against
    assert own.problem is None and is_correct(own, right) is None
