"""Admitting the approximate mode a vLLM engine can run (`naive`) by what it does to graded answers.

Calibration (`calibrate`) judges a mode call by call against dense prefill: mean KL and the
share of first tokens kept. Those bars reject K/V reused at new positions even where the
answers it leads to are as often right (a pipeline's later agents restate rather than copy).
An engine's mode is judged here by its answers instead: the graded runs of `bench vllm
--problems` pair each graded answer of `kvsplice-gated` (approximate reuse asked for) with
recompute's answer to the same problem; the paired difference over all graded answers and
its 95% interval (`vllm_graded`) decide.

The rule (`AdmissionRule`): admit when at least `min_answers` answers were graded and the
interval's lower bound is at least `-tolerance_points`, i.e. the mode is shown to lose no more
than the tolerance. The policy records the counts and the problems graded.

Held out (`confirm`): runs of problems the calibration never graded, under the policy it
wrote (same engine fingerprint), confirm the admission when their own interval does not
show a loss beyond the tolerance (upper bound >= -tolerance) and calibration and held-out
answers pooled still keep the lower bound >= -tolerance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kvsplice.client.modes.admission import AdmissionPolicy, GradedAccuracy
from kvsplice.client.modes.registry import SAFE_MODES
from kvsplice.eval.bench.vllm_graded import paired_cells, paired_difference

# the mode a KV connector can carry (integrations.vllm.reuse_policy's SPAN_MODE)
ENGINE_MODE = "naive"
GATED = "kvsplice-gated"
REFERENCE = "recompute"


@dataclass(frozen=True)
class AdmissionRule:
    """Admit where at least `min_answers` graded answers show the mode losing no more than
    `tolerance_points` against recompute (the paired 95% interval's lower bound)."""

    tolerance_points: float = 2.0
    min_answers: int = 300

    def __post_init__(self) -> None:
        if not 0 <= self.tolerance_points <= 100:
            raise ValueError(f"tolerance_points {self.tolerance_points} not in [0, 100]")
        if self.min_answers < 1:
            raise ValueError(f"min_answers {self.min_answers} < 1")


@dataclass(frozen=True)
class Verdict:
    """Whether the rule admits (or a held-out run confirms), why, and the evidence."""

    admitted: bool
    reason: str
    evidence: GradedAccuracy

    def as_json(self) -> dict[str, Any]:
        return {"admitted": self.admitted, "reason": self.reason, **figures(self.evidence)}


def figures(found: GradedAccuracy) -> dict[str, Any]:
    """What a report says of graded answers: the difference, its interval, how many."""
    return {
        "points": found.points, "ci95_points": list(found.ci95_points),
        "answers": found.num_answers, "problems": len(found.problems),
        "tolerance_points": found.tolerance_points,
    }  # fmt: skip


def gated_label(pooled: Mapping[str, Any], label: str | None = None) -> str:
    """The configuration judged: `label`, or the only `kvsplice-gated` one pooled."""
    labels = [row["label"] for row in pooled["configs"]]
    if label is not None:
        if label not in labels:
            raise ValueError(f"no configuration {label!r} graded (graded: {labels})")
        return label
    gated = [name for name in labels if name.split(" (")[0] == GATED]
    if len(gated) != 1:
        raise ValueError(f"name the configuration to judge (--config): graded {labels}")
    return gated[0]


def evidence(
    pooled: Mapping[str, Any], label: str, rule: AdmissionRule, workload: str
) -> GradedAccuracy:
    """`label`'s graded answers paired with recompute's (`vllm_graded.pool`'s shape)."""
    rows = {row["label"]: row["graded"] for row in pooled["configs"]}
    if REFERENCE not in rows:
        raise ValueError("no recompute runs to pair the graded answers with")
    pairs = [
        (run["right"][role], ref["right"][role])
        for run, ref in zip(rows[label]["runs"], rows[REFERENCE]["runs"], strict=True)
        for role in sorted(run["right"])
    ]  # fmt: skip
    return _accuracy(
        paired_cells(pairs), [run["problem"] for run in rows[label]["runs"]], rule, workload
    )


def _accuracy(
    cells: Sequence[int], problems: Sequence[str], rule: AdmissionRule, workload: str
) -> GradedAccuracy:
    both, mode_only, recompute_only, neither = cells
    n = sum(cells)
    low, high = paired_difference(both, mode_only, recompute_only, neither)
    points = 100 * (mode_only - recompute_only) / n if n else 0.0
    return GradedAccuracy(
        both, mode_only, recompute_only, neither, points, (100 * low, 100 * high),
        tuple(problems), rule.tolerance_points, workload,
    )  # fmt: skip


def judge(found: GradedAccuracy, rule: AdmissionRule) -> Verdict:
    """The rule applied to calibration's graded answers."""
    low, high = found.ci95_points
    interval = f"{found.points:+.1f} points (95% {low:+.1f} to {high:+.1f})"
    if found.num_answers < rule.min_answers:
        return Verdict(False, f"{found.num_answers} graded answers < {rule.min_answers}", found)
    if low < -rule.tolerance_points:
        return Verdict(
            False, f"{interval}: may lose more than {rule.tolerance_points:g} points", found
        )
    return Verdict(
        True, f"{interval} on {found.num_answers} answers: loses at most "
        f"{rule.tolerance_points:g} points", found,
    )  # fmt: skip


def admission_policy(fingerprint: str, verdict: Verdict) -> AdmissionPolicy:
    """The engine's policy: `naive` admitted where the verdict admits it; its evidence kept."""
    modes = (*SAFE_MODES, ENGINE_MODE) if verdict.admitted else SAFE_MODES
    return AdmissionPolicy(
        fingerprint, modes, created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        graded={ENGINE_MODE: verdict.evidence},
    )  # fmt: skip


def confirm(
    held_out: Mapping[str, Any], policy: AdmissionPolicy, fingerprint: str,
    label: str, rule: AdmissionRule,
) -> tuple[Verdict, GradedAccuracy]:  # fmt: skip
    """Whether the held-out runs `held_out` (pooled) confirm `policy`'s admission of `naive`:
    the held-out verdict and calibration and held-out pooled."""
    calibrated = policy.graded.get(ENGINE_MODE)
    if calibrated is None:
        raise ValueError("the policy records no graded answers for naive: nothing to confirm")
    if fingerprint != policy.model_fingerprint:
        raise ValueError(
            f"the held-out runs served {fingerprint}, the policy is {policy.model_fingerprint}'s"
        )
    if ENGINE_MODE not in policy.admitted_modes:
        raise ValueError("the policy does not admit naive: nothing to confirm")
    found = evidence(held_out, label, rule, calibrated.workload)
    seen = set(found.problems) & set(calibrated.problems)
    if seen:
        raise ValueError(f"not held out: the calibration graded {sorted(seen)}")
    combined = (
        calibrated.both + found.both, calibrated.mode_only + found.mode_only,
        calibrated.recompute_only + found.recompute_only, calibrated.neither + found.neither,
    )  # fmt: skip
    pooled = _accuracy(combined, (*calibrated.problems, *found.problems), rule, found.workload)
    low, high = found.ci95_points
    interval = f"held out {found.points:+.1f} points (95% {low:+.1f} to {high:+.1f})"
    together = (
        f"with calibration {pooled.points:+.1f} (95% {pooled.ci95_points[0]:+.1f} to "
        f"{pooled.ci95_points[1]:+.1f}) on {pooled.num_answers} answers"
    )
    if high < -rule.tolerance_points:
        return Verdict(False, f"{interval}: loses more than the tolerance", found), pooled
    if pooled.ci95_points[0] < -rule.tolerance_points:
        return Verdict(False, f"{interval}; {together}: may lose more", found), pooled
    return Verdict(True, f"{interval}; {together}", found), pooled


def workload_of(report: Mapping[str, Any]) -> str:
    """What a `bench vllm --problems` report's answers came from, in words."""
    return (
        f"HumanEval, {report.get('layout')} 5-agent pipeline, {report.get('answer_tokens')}-token "
        f"answers, {report.get('dtype')}"
    )


def report_fingerprint(reports: Sequence[Mapping[str, Any]]) -> str:
    """The engines' fingerprint the reports record (`served_fingerprint`); for reports
    that predate it, the one vLLM computes for their model and dtype (needs vLLM:
    `.venv-vllm`). All must agree."""
    recorded = {report.get("served_fingerprint") for report in reports}
    known = {str(found) for found in recorded if found is not None}
    if None in recorded:
        report = next(r for r in reports if r.get("served_fingerprint") is None)
        known.add(served_fingerprint(str(report["model_dir"]), str(report["dtype"])))
    if len(known) != 1:
        raise ValueError(f"the reports served different models: {sorted(known)}")
    return known.pop()


def served_fingerprint(model_dir: str, dtype: str) -> str:
    """The fingerprint a vLLM engine serving `model_dir` in `dtype` stores K/V under."""
    try:
        from vllm.config import ModelConfig
    except ImportError as error:
        raise ValueError(
            "the reports do not record the engines' fingerprint and vLLM is not installed here "
            "to compute it: run this from .venv-vllm"
        ) from error
    from kvsplice.integrations.vllm.connector import served_fingerprint as of_engine

    return of_engine(ModelConfig(model=model_dir, dtype=dtype), dtype)
