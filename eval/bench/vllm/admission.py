"""Admitting an approximate mode for vLLM engines by the graded yardstick, and confirming it.

Calibration (`admit`): the graded runs of `bench vllm --workload W --problems ...` (recompute,
exact `kvsplice`, the mode's configuration and the negative controls, in the same runs)
are judged by `yardstick`: one decision per configuration. The engines' policy admits a
mode (`YardstickRule.mode_configs`: `kvsplice-gated` runs `naive`) only when its decision
admits it, every control is refused, exact is admitted, the rule file was committed before
the runs started, no problem of the rule's held-out draw was graded, and the problems graded
are the head of the rule's calibration draw (none picked by hand). The policy keeps
every decision (`decisions`) and why the mode was or was not admitted (`yardstick`).

Held out (`confirm`): runs of problems from the rule's held-out draw only, under the policy
`admit` wrote (same engine fingerprint), confirm it when each admitted mode's configuration
is admitted by the same rule on them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvsplice.client.modes.admission import AdmissionPolicy
from kvsplice.client.modes.registry import SAFE_MODES
from kvsplice.eval.bench.vllm import yardstick as ys
from kvsplice.eval.bench.vllm.config import WORKLOAD_SIZES


def admit(
    reports: Sequence[Mapping[str, Any]], pooled: Mapping[str, Any], fingerprint: str,
    rule: ys.YardstickRule, rule_path: Path = ys.RULE_PATH,
) -> tuple[AdmissionPolicy, str]:  # fmt: skip
    """The engines' policy these reports decide, and a line saying what it admits and why."""
    workload = _workload(reports)
    graded = {run["problem"] for row in pooled["configs"] for run in row["graded"]["runs"]}
    drawn = {_problem_id(workload, i) for i in rule.held_out(workload, WORKLOAD_SIZES[workload])}
    if graded & drawn:
        raise ValueError(f"the calibration graded held-out problems: {sorted(graded & drawn)[:5]}")
    draw = rule.calibration_draw(workload, WORKLOAD_SIZES[workload], len(graded))
    picked = graded - {_problem_id(workload, i) for i in draw}
    if picked:
        raise ValueError(
            f"the calibration graded problems outside the rule's draw (its first {len(graded)}, "
            f"`kvsplice bench yardstick-draw {workload} --count {len(graded)}`): {sorted(picked)[:5]}"
        )
    found = ys.decisions(pooled, rule)
    why_not = ys.sensitivity(found, rule) or _rule_fixed_before(reports, rule_path)
    by_config = {d.config: d for d in found}
    modes = [
        mode for config, mode in rule.mode_configs.items()
        if why_not is None and config in by_config and by_config[config].admitted
    ]  # fmt: skip
    commit = ys.rule_commit(rule_path)
    yardstick = {
        "workload": workload, "rule": str(rule_path), "rule_commit": commit and commit[0],
        "sensitive": why_not is None, "why_not": why_not,
    }  # fmt: skip
    policy = AdmissionPolicy(
        fingerprint, (*SAFE_MODES, *modes), created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        decisions=tuple(d.as_json() for d in found), yardstick=yardstick,
    )  # fmt: skip
    what = f"admits {', '.join(modes)}" if modes else "admits exact only"
    return policy, f"{what} for {fingerprint} ({workload}): " + (why_not or _reasons(found))


def confirm(
    reports: Sequence[Mapping[str, Any]], pooled: Mapping[str, Any], policy: AdmissionPolicy,
    fingerprint: str, rule: ys.YardstickRule,
) -> tuple[bool, str, list[ys.Decision]]:  # fmt: skip
    """Whether held-out runs confirm `policy`'s admitted modes, why, and their decisions."""
    if fingerprint != policy.model_fingerprint:
        raise ValueError(
            f"the held-out runs served {fingerprint}, the policy is {policy.model_fingerprint}'s"
        )
    admitted = [m for m in policy.admitted_modes if m not in SAFE_MODES]
    if not admitted:
        raise ValueError("the policy admits no approximate mode: nothing to confirm")
    workload = _workload(reports)
    drawn = {_problem_id(workload, i) for i in rule.held_out(workload, WORKLOAD_SIZES[workload])}
    graded = {run["problem"] for row in pooled["configs"] for run in row["graded"]["runs"]}
    if graded - drawn:
        raise ValueError(f"not held out (outside the rule's draw): {sorted(graded - drawn)[:5]}")
    found = ys.decisions(pooled, rule)
    by_config = {d.config: d for d in found}
    configs = [c for c, mode in rule.mode_configs.items() if mode in admitted]
    missing = [c for c in configs if c not in by_config]
    if missing:
        return False, f"{', '.join(missing)} not graded held out", found
    refused = [by_config[c] for c in configs if not by_config[c].admitted]
    if refused:
        return False, f"{refused[0].config}: {refused[0].reason}", found
    return True, _reasons([by_config[c] for c in configs]), found


def _reasons(found: Sequence[ys.Decision]) -> str:
    return "; ".join(
        f"{d.config} {'admitted' if d.admitted else 'refused'}: {d.reason}" for d in found
    )


def _workload(reports: Sequence[Mapping[str, Any]]) -> str:
    names = {str(report.get("workload") or "humaneval") for report in reports}
    if len(names) != 1:
        raise ValueError(f"the reports graded different workloads: {sorted(names)}")
    return names.pop()


def _problem_id(workload: str, index: int) -> str:
    return f"HumanEval/{index}" if workload == "humaneval" else f"{workload}-test-{index}"


def _rule_fixed_before(reports: Sequence[Mapping[str, Any]], rule_path: Path) -> str | None:
    """Why the rule cannot judge these runs (None: committed before every one started)."""
    commit = ys.rule_commit(rule_path)
    if commit is None:
        return f"the rule {rule_path} is not committed as it stands: fix it in a commit first"
    for report in reports:
        started = report.get("started_at")
        if started is None:
            return "a report does not record when its run started (older than the yardstick)"
        if datetime.fromisoformat(started) < commit[1]:
            return (
                f"the rule was committed ({commit[1].isoformat()}) after a run started ({started})"
            )
    return None


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
