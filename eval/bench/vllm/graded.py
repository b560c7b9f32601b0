"""Grading the answers of `kvsplice bench vllm --problems`: accuracy per configuration.

Owns what one graded pipeline run is worth and what a configuration's runs add up to. A
run is the 5-agent pipeline of a workload (`graded_pipelines`) on one problem, its graded
roles graded by the workload: HumanEval's code run against the problem's tests and its
judge's PASS/FAIL against the reviser's result; MMLU's and GSM8K's answers against the
reference, their judge (which selects between the solver's and the reviser's answers)
counted only on problems where recompute's two candidates were one right, one wrong
(`judge_graded`). Each answer records whether it hit the token cap (`truncated`). The
by-problem yardstick that admits a mode is `yardstick`'s. A configuration's figures are each role's accuracy with n and a
95% Wilson interval, and against `recompute`'s runs of the same problems the paired
difference in points with its 95% interval (`paired_difference`: Newcombe's score interval
for paired proportions) and how many runs each got right alone; `all` pools the three
graded roles. `pool` adds up the runs of several `--problems` reports of one setup.
Running the pipelines is `bench`'s.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvsplice.eval.workloads.graded_pipelines import JUDGE, ROLES, GradedPipeline, judge_answer
from kvsplice.eval.workloads.workload import Problem

JUDGE_ROLE = JUDGE
GRADED = ("solver", "reviser", JUDGE)
_ROLES = ROLES


@dataclass(frozen=True)
class GradedRun:
    """One problem's pipeline: whether each graded role got it right (`right`, by role),
    the judge's answer as read (None: none found), the agents' outputs as tokens, and
    per agent the prompt tokens loaded from outside the engine and the prompt's length, and
    the answers as read (`answers`, in role order: what a reader checks a grade against);
    `judge_graded`: whether this run's candidates make its judge gradable; `truncated`:
    per agent, whether its answer hit the token cap; `ttft_s`: per agent, its time to first
    token (under the run's concurrency: beside other problems' pipelines)."""

    problem_id: str
    right: dict[str, bool]
    verdict: str | None
    outputs: tuple[tuple[int, ...], ...]
    cached_tokens: tuple[int, ...] = ()
    prompt_tokens: tuple[int, ...] = ()
    answers: tuple[str, ...] = ()
    judge_graded: bool = True
    truncated: tuple[bool, ...] = ()
    ttft_s: tuple[float, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {
            "problem": self.problem_id, "right": self.right, "judge_verdict": self.verdict,
            "judge_graded": self.judge_graded,
            "truncated": dict(zip(_ROLES[: len(self.truncated)], self.truncated, strict=True)),
            "cached_tokens": list(self.cached_tokens), "prompt_tokens": list(self.prompt_tokens),
            "answers": dict(zip(_ROLES[: len(self.answers)], self.answers, strict=True)),
            "ttft_s": list(self.ttft_s),
        }  # fmt: skip


def grade_run(
    pipeline: GradedPipeline, problem: Problem, texts: Sequence[str],
    outputs: Sequence[Sequence[int]], answer_tokens: int | None = None,
) -> GradedRun:  # fmt: skip
    """Grade one pipeline run: `texts` (and their token ids, `outputs`) in role order; an
    answer of `answer_tokens` tokens (the cap) counts as truncated."""
    if len(texts) != len(_ROLES) or len(outputs) != len(_ROLES):
        raise ValueError(f"a pipeline run has {len(_ROLES)} answers, got {len(texts)}")
    answer = dict(zip(_ROLES, texts, strict=True))
    right, judge_graded = pipeline.grade(problem, answer)
    outputs_ids = tuple(tuple(o) for o in outputs)
    truncated = tuple(answer_tokens is not None and len(o) >= answer_tokens for o in outputs_ids)
    return GradedRun(
        problem.problem_id, right, judge_answer(pipeline, answer[JUDGE]), outputs_ids,
        answers=tuple(texts), judge_graded=judge_graded, truncated=truncated,
    )  # fmt: skip


def agent5_ttft(runs: Sequence[Mapping[str, Any]]) -> float | None:
    """The last agent's median time to first token over the runs (`as_json`'s form) that
    recorded one (None: none did; reports from before runs were timed)."""
    timed = [run["ttft_s"][-1] for run in runs if run.get("ttft_s")]
    return statistics.median(timed) if timed else None


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


def paired_difference(
    both: int, here_only: int, there_only: int, neither: int, z: float = 1.96
) -> tuple[float, float]:
    """The 95% interval of p_here - p_there for paired right/wrong answers (Newcombe 1998,
    method 10: the two Wilson intervals combined with the pairs' continuity-corrected
    correlation); n = 0: the whole [-1, 1]."""
    cells = (both, here_only, there_only, neither)
    if min(cells) < 0:
        raise ValueError(f"negative counts {cells}")
    n = sum(cells)
    if n == 0:
        return -1.0, 1.0
    p1, p2 = (both + here_only) / n, (both + there_only) / n
    (l1, u1), (l2, u2) = wilson(both + here_only, n, z), wilson(both + there_only, n, z)
    margins = (
        (both + here_only) * (there_only + neither) * (both + there_only) * (here_only + neither)
    )
    excess: float = both * neither - here_only * there_only
    if 0 <= excess <= n / 2:  # Newcombe's continuity correction of the correlation
        excess = 0
    elif excess > n / 2:
        excess -= n / 2
    phi = excess / math.sqrt(margins) if margins else 0.0
    below = (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    above = (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    difference = p1 - p2
    return max(-1.0, difference - math.sqrt(max(0.0, below))), min(
        1.0, difference + math.sqrt(max(0.0, above))
    )


def paired_cells(pairs: Sequence[tuple[bool, bool]]) -> tuple[int, int, int, int]:
    """(both right, right here only, right there only, neither) of (here, there) answers."""
    both = sum(here and there for here, there in pairs)
    here_only = sum(here and not there for here, there in pairs)
    there_only = sum(there and not here for here, there in pairs)
    return both, here_only, there_only, len(pairs) - both - here_only - there_only


def _figures(pairs: Sequence[tuple[bool, bool]]) -> dict[str, Any]:
    """Accuracy and the paired difference against the reference of (here, there) answers."""
    n = len(pairs)
    right = sum(here for here, _ in pairs)
    both, here_only, there_only, neither = paired_cells(pairs)
    low, high = wilson(right, n)
    d_low, d_high = paired_difference(both, here_only, there_only, neither)
    return {
        "right": right, "n": n, "accuracy": right / n if n else None, "ci95": [low, high],
        "vs_recompute_points": 100 * (here_only - there_only) / n if n else None,
        "vs_recompute_ci95_points": [100 * d_low, 100 * d_high],
        "right_only_here": here_only, "right_only_recompute": there_only,
    }  # fmt: skip


def role_pairs(
    here: Sequence[Mapping[str, Any]], there: Sequence[Mapping[str, Any]]
) -> dict[str, list[tuple[bool, bool]]]:
    """Per graded role, (here right, there right) of each problem's runs (`as_json`'s form,
    `there` the reference): the judge only where the reference's judge was gradable."""
    return {
        role: [
            (a["right"][role], b["right"][role]) for a, b in zip(here, there, strict=True)
            if role != JUDGE or b.get("judge_graded", True)
        ]
        for role in GRADED
    }  # fmt: skip


def _role_figures(
    here: Sequence[dict[str, Any]], there: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """Per graded role and pooled over them (`all`), from the runs (`as_json`'s form)."""
    pairs = role_pairs(here, there)
    roles = {role: _figures(pairs[role]) for role in GRADED}
    roles["all"] = _figures([pair for role in GRADED for pair in pairs[role]])
    return roles


def summarize(runs: Sequence[GradedRun], reference: Sequence[GradedRun]) -> dict[str, Any]:
    """Each graded role's accuracy (n, 95% interval) and, against `reference` (recompute's
    runs of the same problems, in the same order), the difference in points with its 95%
    interval, the runs right only here and only there (also pooled over the roles: `all`),
    and how many agent outputs equal the reference's."""
    if [r.problem_id for r in runs] != [r.problem_id for r in reference]:
        raise ValueError("graded runs and the reference's cover different problems")
    equal = [
        a == b for run, ref in zip(runs, reference, strict=True)
        for a, b in zip(run.outputs, ref.outputs, strict=True)
    ]  # fmt: skip
    return {
        "roles": _role_figures([r.as_json() for r in runs], [r.as_json() for r in reference]),
        "outputs_equal_recompute": sum(equal),
        "outputs": len(equal),
        "agent5_ttft_s": agent5_ttft([r.as_json() for r in runs]),
        "runs": [r.as_json() for r in runs],
    }


POOLED_SETUP = ("model_dir", "dtype", "layout", "answer_tokens", "chunk_tokens", "workload")


def pool(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The graded runs of several `bench vllm --problems` reports (their JSON) added up per
    configuration and summarized as one run would be: the reports must share the setup
    (`POOLED_SETUP`) and grade disjoint problems. Configurations are keyed by label."""
    if not reports:
        raise ValueError("no reports to pool")
    for key in POOLED_SETUP:
        values = {repr(report.get(key)) for report in reports}
        if len(values) > 1:
            raise ValueError(f"the reports differ in {key}: {sorted(values)}")
    runs: dict[str, list[dict[str, Any]]] = {}
    outputs: dict[str, list[int]] = {}
    seen: set[str] = set()
    for report in reports:
        graded = [row for row in report["configs"] if row.get("graded")]
        if not any(row["label"] == "recompute" for row in graded):
            raise ValueError("a report without recompute's graded runs cannot be pooled")
        problems = {run["problem"] for run in graded[0]["graded"]["runs"]}
        if problems & seen:
            raise ValueError(f"problems graded twice: {sorted(problems & seen)}")
        seen |= problems
        for row in graded:
            runs.setdefault(row["label"], []).extend(row["graded"]["runs"])
            counts = outputs.setdefault(row["label"], [0, 0])
            counts[0] += row["graded"]["outputs_equal_recompute"]
            counts[1] += row["graded"]["outputs"]
    reference = runs["recompute"]
    pooled = []
    for label, rows in runs.items():
        if [r["problem"] for r in rows] != [r["problem"] for r in reference]:
            raise ValueError(f"{label} graded other problems than recompute")
        pooled.append({
            "label": label, "name": label,
            "graded": {
                "roles": _role_figures(rows, reference),
                "outputs_equal_recompute": outputs[label][0], "outputs": outputs[label][1],
                "agent5_ttft_s": agent5_ttft(rows), "runs": rows,
            },
        })  # fmt: skip
    return {"configs": pooled, "problems": len(reference), "reports": len(reports)}


def _points(value: float | None, spec: str) -> str:
    """A difference in points, signed; "—" where nothing was graded."""
    return "—" if value is None else format(value, "+" + spec)


def print_graded(rows: Sequence[dict[str, Any]], console: Any) -> None:
    """Each configuration's accuracy per graded role (95% interval), the difference from
    recompute per role, and over all graded answers with its 95% interval (recompute's
    row: its right answers of all), and agent 5's median TTFT (under the runs' concurrency)."""
    from kvsplice.eval.report.tables import figures_table

    columns = (
        "config", *(f"{role} right" for role in GRADED), "vs rec (points)",
        "all: vs rec (95% CI)", "equal outputs", "agent 5 TTFT",
    )  # fmt: skip
    table = figures_table(columns, ("config",), title="bench vllm --problems: graded answers")
    for row in rows:
        graded = row.get("graded")
        if not graded:
            continue
        roles = graded["roles"]
        cells = [
            f"{r['right']}/{r['n']} ({100 * r['ci95'][0]:.0f}-{100 * r['ci95'][1]:.0f}%)"
            for r in (roles[role] for role in GRADED)
        ]
        points = " / ".join(_points(roles[role]["vs_recompute_points"], ".0f") for role in GRADED)
        pooled = roles["all"]
        low, high = pooled["vs_recompute_ci95_points"]
        overall = (
            f"{pooled['right']}/{pooled['n']}" if row["label"] == "recompute"
            else f"{_points(pooled['vs_recompute_points'], '.1f')} ({low:+.1f} to {high:+.1f})"
        )  # fmt: skip
        equal = f"{graded['outputs_equal_recompute']}/{graded['outputs']}"
        ttft = graded.get("agent5_ttft_s")
        timed = "—" if ttft is None else f"{ttft:.2f} s"
        table.add_row(row["label"], *cells, points, overall, equal, timed)
    console.print(table)
