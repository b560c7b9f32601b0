"""Grading the answers of `kvsplice bench vllm --problems`: accuracy per configuration.

Owns what one graded pipeline run is worth and what a configuration's runs add up to. A
run is the 5-agent pipeline on one HumanEval problem (`PIPELINE_ROLES`); its `solver` and
`reviser` answers are code, run against the problem's tests (`passes_tests`), and its
`judge` answers PASS or FAIL about the reviser's solution, right when it matches that
solution's test result. A configuration's figures are each role's accuracy with n and a
95% Wilson interval, and against `recompute`'s runs of the same problems the paired
difference in points and how many runs each got right alone (what the interval of a
difference rests on). Running the pipelines is `vllm_bench`'s.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsplice.eval.workloads.humaneval import passes_tests
from kvsplice.eval.workloads.token_transcript import PIPELINE_ROLES
from kvsplice.eval.workloads.workload import Problem

CODE_ROLES = ("solver", "reviser")
JUDGE_ROLE = "judge"
JUDGED_ROLE = "reviser"  # whose solution the judge's verdict is about
GRADED = (*CODE_ROLES, JUDGE_ROLE)
_VERDICT = re.compile(r"\b(PASS|FAIL)\b")
_ROLES = tuple(role for role, _ in PIPELINE_ROLES)


@dataclass(frozen=True)
class GradedRun:
    """One problem's pipeline: whether each graded role got it right (`right`, by role),
    the judge's verdict as read (None: neither word), the agents' outputs as tokens, and
    per agent the prompt tokens loaded from outside the engine and the prompt's length."""

    problem_id: str
    right: dict[str, bool]
    verdict: str | None
    outputs: tuple[tuple[int, ...], ...]
    cached_tokens: tuple[int, ...] = ()
    prompt_tokens: tuple[int, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {
            "problem": self.problem_id, "right": self.right, "judge_verdict": self.verdict,
            "cached_tokens": list(self.cached_tokens), "prompt_tokens": list(self.prompt_tokens),
        }  # fmt: skip


def grade_run(
    problem: Problem, texts: Sequence[str], outputs: Sequence[Sequence[int]]
) -> GradedRun:
    """Grade one pipeline run: `texts` (and their token ids, `outputs`) in role order."""
    if len(texts) != len(_ROLES) or len(outputs) != len(_ROLES):
        raise ValueError(f"a pipeline run has {len(_ROLES)} answers, got {len(texts)}")
    answer = dict(zip(_ROLES, texts, strict=True))
    right = {role: passes_tests(problem, answer[role]) for role in CODE_ROLES}
    found = _VERDICT.search(answer[JUDGE_ROLE])
    verdict = found.group(1) if found else None
    right[JUDGE_ROLE] = verdict is not None and (verdict == "PASS") == right[JUDGED_ROLE]
    return GradedRun(problem.problem_id, right, verdict, tuple(tuple(o) for o in outputs))


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of `successes` in `n` (n = 0: the whole [0, 1])."""
    if not 0 <= successes <= n:
        raise ValueError(f"{successes} successes in {n} trials")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(runs: Sequence[GradedRun], reference: Sequence[GradedRun]) -> dict[str, Any]:
    """Each graded role's accuracy (n, 95% interval) and, against `reference` (recompute's
    runs of the same problems, in the same order), the difference in points, the runs right
    only here and only there, and how many agent outputs equal the reference's."""
    if [r.problem_id for r in runs] != [r.problem_id for r in reference]:
        raise ValueError("graded runs and the reference's cover different problems")
    n = len(runs)
    roles: dict[str, Any] = {}
    for role in GRADED:
        right = sum(r.right[role] for r in runs)
        ref = sum(r.right[role] for r in reference)
        low, high = wilson(right, n)
        roles[role] = {
            "right": right, "n": n, "accuracy": right / n if n else None,
            "ci95": [low, high],
            "vs_recompute_points": 100 * (right - ref) / n if n else None,
            "right_only_here": sum(a.right[role] and not b.right[role]
                                   for a, b in zip(runs, reference, strict=True)),
            "right_only_recompute": sum(b.right[role] and not a.right[role]
                                        for a, b in zip(runs, reference, strict=True)),
        }  # fmt: skip
    equal = [
        a == b for run, ref in zip(runs, reference, strict=True)
        for a, b in zip(run.outputs, ref.outputs, strict=True)
    ]  # fmt: skip
    return {
        "roles": roles,
        "outputs_equal_recompute": sum(equal),
        "outputs": len(equal),
        "runs": [r.as_json() for r in runs],
    }
