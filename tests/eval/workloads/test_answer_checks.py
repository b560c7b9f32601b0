"""Scoring: numbers for math, letters for multiple choice, HumanEval code run in a child process."""

from __future__ import annotations

import gzip
import json
from decimal import Decimal

import pytest

from kvsplice.eval.workloads.code_exec import ExecLimits, run_program
from kvsplice.eval.workloads.humaneval import (
    build_program,
    extract_code,
    humaneval_path,
    load_humaneval,
    passes_tests,
)
from kvsplice.eval.workloads.math_problems import last_number, numbers_match
from kvsplice.eval.workloads.multiple_choice import chosen_letter
from kvsplice.eval.workloads.workload import Problem

FAST = ExecLimits(timeout_s=3.0, cpu_s=3)


@pytest.mark.parametrize(
    ("output", "reference", "expected"),
    [
        ("So she has 18 apples.\nAnswer: 18", "18", True),
        ("Total: $1,250.", "1250", True),
        ("It is 7.00", "7", True),
        ("First 18, then 20", "18", False),  # the last number counts
        ("-4 degrees", "-4", True),
        ("no number here", "3", False),
    ],
)
def test_numbers_match_uses_the_last_number(output: str, reference: str, expected: bool) -> None:
    assert numbers_match(output, reference) is expected


def test_last_number_reads_thousands_separators() -> None:
    assert last_number("from 3 to 12,000 units") == Decimal("12000")
    assert last_number("") is None


@pytest.mark.parametrize(
    ("output", "letter"),
    [
        ("B", "B"),
        ("C.", "C"),
        ("(A) Paris", "A"),
        ("The answer is D because spiders have eight legs.", "D"),
        ("Answer: (c)", None),  # lowercase letters are words, not options
        ("A good guess is C", "C"),  # a sentence-initial article is not option A
        ("I cannot tell.", None),
    ],
)
def test_chosen_letter(output: str, letter: str | None) -> None:
    assert chosen_letter(output) == letter


def test_extract_code_prefers_fenced_blocks_and_tolerates_a_cut_fence() -> None:
    answer = "Here:\n```python\ndef f():\n    return 1\n```\nand\n```\nx = 2\n```"
    assert extract_code(answer) == "def f():\n    return 1\n\n\nx = 2\n"
    assert extract_code("```python\ndef g():\n    return") == "def g():\n    return"
    assert extract_code("    return 3\n") == "    return 3\n"


def test_run_program_passes_fails_and_times_out() -> None:
    assert run_program("total = sum(range(4))\nassert total == 6\n", FAST).passed
    failed = run_program("raise SystemExit(3)\n", FAST)
    assert (failed.passed, failed.timed_out, failed.returncode) == (False, False, 3)
    looped = run_program("while True:\n    pass\n", ExecLimits(timeout_s=0.5, cpu_s=5))
    assert (looped.passed, looped.timed_out) == (False, True)


def test_run_program_sets_the_limits_before_the_program_runs() -> None:
    check = (
        "import resource\n"
        "assert resource.getrlimit(resource.RLIMIT_CPU) == (3, 3)\n"
        "assert resource.getrlimit(resource.RLIMIT_NOFILE) == (64, 64)\n"
        "assert resource.getrlimit(resource.RLIMIT_CORE) == (0, 0)\n"
    )
    result = run_program(check, FAST)
    assert result.passed, result.stderr_tail


def test_run_program_caps_memory() -> None:
    hog = run_program("x = bytearray(1 << 30)\n", ExecLimits(timeout_s=3.0, memory_bytes=256 << 20))
    assert not hog.passed
    assert "MemoryError" in hog.stderr_tail


def test_run_program_does_not_share_this_process() -> None:
    """The child cannot see this process's modules: it is a fresh interpreter."""
    assert not run_program("import sys\nassert 'pytest' in sys.modules\n", FAST).passed


@pytest.fixture(scope="module")
def first_problem() -> Problem:
    return load_humaneval(limit=1)[0]


def canonical_solution(task_id: str) -> str:
    """The reference body HumanEval ships for `task_id`."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as lines:
        return next(
            json.loads(line)["canonical_solution"] for line in lines if f'"{task_id}"' in line
        )


def test_humaneval_canonical_body_and_full_function_pass(first_problem: Problem) -> None:
    body = canonical_solution(first_problem.problem_id)
    assert passes_tests(first_problem, body, FAST)
    full = first_problem.extras["prompt"] + body
    assert passes_tests(first_problem, f"```python\n{full}```", FAST)


def test_humaneval_wrong_and_looping_completions_fail(first_problem: Problem) -> None:
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    assert not passes_tests(first_problem, wrong, FAST)
    looping = (
        "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```"
    )
    assert not passes_tests(first_problem, looping, ExecLimits(timeout_s=0.5, cpu_s=5))


def test_build_program_calls_check_on_the_entry_point(first_problem: Problem) -> None:
    program = build_program(first_problem, "    return True\n")
    assert program.rstrip().endswith("check(has_close_elements)")
    assert program.startswith(first_problem.extras["prompt"] + "    return True")
