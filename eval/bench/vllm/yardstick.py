"""The graded yardstick: whether graded answers admit an approximate mode, by problem.

Owns the rule (`YardstickRule`, read from `yardstick_rule.json`, committed before the runs
it judges) and the decisions: per configuration graded beside recompute, each graded role's
recompute accuracy (a role outside the rule's band is reported, not graded), the difference
in points per problem (a pipeline's answers are one cluster: each problem's graded roles
averaged) with a paired bootstrap interval over problems, the discordant answers, and
admitted when enough problems were graded, few enough answers hit the token cap and the
interval's lower bound is within the tolerance. A mode is admitted only where the yardstick
is shown sensitive in the same runs: every negative control refused and exact admitted.
Grading one run is `graded`'s; writing the engines' policy is `admission`'s.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvsplice.eval.bench.vllm.graded import GRADED, JUDGE_ROLE, agent5_ttft, role_pairs
from kvsplice.eval.workloads.olmo_data import seeded_subset

RULE_PATH = Path(__file__).resolve().parent / "yardstick_rule.json"
REFERENCE = "recompute"


@dataclass(frozen=True)
class YardstickRule:
    """The rule's fields (see `yardstick_rule.json`)."""

    tolerance_points: float
    min_problems: int
    accuracy_band: tuple[float, float]
    max_truncated_share: float
    resamples: int
    seed: int
    level: float
    mode_configs: Mapping[str, str]
    must_refuse: tuple[str, ...]
    must_admit: tuple[str, ...]
    held_out_seed: int
    held_out_problems: Mapping[str, int]
    calibration_seed: int

    def __post_init__(self) -> None:
        low, high = self.accuracy_band
        if not 0 <= low < high <= 1:
            raise ValueError(f"accuracy_band {self.accuracy_band} not within [0, 1]")
        if not 0 <= self.tolerance_points <= 100 or self.min_problems < 1:
            raise ValueError(f"tolerance {self.tolerance_points}, min_problems {self.min_problems}")
        if self.resamples < 100 or not 0.5 < self.level < 1:
            raise ValueError(f"resamples {self.resamples}, level {self.level}")

    @classmethod
    def from_json(cls, text: str) -> YardstickRule:
        document = json.loads(text)
        try:
            interval, held = document["interval"], document["held_out"]
            return cls(
                float(document["tolerance_points"]), int(document["min_problems"]),
                (float(document["accuracy_band"][0]), float(document["accuracy_band"][1])),
                float(document["max_truncated_share"]), int(interval["resamples"]),
                int(interval["seed"]), float(interval["level"]), dict(document["mode_configs"]),
                tuple(document["must_refuse"]), tuple(document["must_admit"]), int(held["seed"]),
                {str(k): int(v) for k, v in held["problems"].items()},
                int(document["calibration"]["seed"]),
            )  # fmt: skip
        except (KeyError, TypeError, IndexError) as error:
            raise ValueError(f"malformed yardstick rule: {error!r}") from error

    def held_out(self, workload: str, num_problems: int) -> set[int]:
        """The problem indices of `workload` (of `num_problems`) drawn for held-out runs."""
        count = self.held_out_problems.get(workload, 0)
        return {i for i, _ in seeded_subset(range(num_problems), count, self.held_out_seed)}

    def calibration_draw(self, workload: str, num_problems: int, count: int) -> list[int]:
        """The first `count` problem indices of the calibration order: `num_problems` indices
        shuffled by the calibration seed, the held-out draw left out. Nested: a larger
        `count` keeps the smaller draw as its head, so runs grow it by disjoint slices."""
        held = self.held_out(workload, num_problems)
        order = seeded_subset(range(num_problems), num_problems, self.calibration_seed)
        return [i for i, _ in order if i not in held][:count]


def load_rule(path: Path = RULE_PATH) -> YardstickRule:
    return YardstickRule.from_json(path.read_text())


@dataclass(frozen=True)
class Decision:
    """One configuration's graded answers judged by the rule (`as_json`: the policy's entry)."""

    config: str
    admitted: bool
    reason: str
    points: float
    ci95: tuple[float, float]
    problems: int
    discordant: int
    recompute_accuracy: Mapping[str, float]
    graded_roles: tuple[str, ...]
    truncated_share: float
    loaded_share: float | None  # prompt tokens of agents 2-5 loaded from outside the engine
    problems_for_half_width: int | None  # problems this discordance needs for ±tolerance
    jcr: float | None = None  # share of gradable judges answering as recompute's judge did
    agent5_ttft_s: float | None = None  # median over the runs that timed it (under concurrency)

    def as_json(self) -> dict[str, Any]:
        return {
            "config": self.config, "admitted": self.admitted, "reason": self.reason,
            "points": self.points, "ci95": list(self.ci95), "problems": self.problems,
            "discordant": self.discordant, "recompute_accuracy": dict(self.recompute_accuracy),
            "graded_roles": list(self.graded_roles), "truncated_share": self.truncated_share,
            "loaded_share_agents_2_5": self.loaded_share,
            "problems_for_half_width": self.problems_for_half_width,
            "jcr_vs_recompute": self.jcr, "agent5_ttft_s": self.agent5_ttft_s,
        }  # fmt: skip


def decide(
    config: str, runs: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]],
    rule: YardstickRule,
) -> Decision:  # fmt: skip
    """`runs` (a configuration's graded runs, `GradedRun.as_json`'s form) against recompute's
    `reference` runs of the same problems, in the same order."""
    if [r["problem"] for r in runs] != [r["problem"] for r in reference]:
        raise ValueError(f"{config} graded other problems than recompute")
    accuracy = recompute_accuracy(reference)
    low, high = rule.accuracy_band
    roles = tuple(role for role in GRADED if role in accuracy and low <= accuracy[role] <= high)
    differences, discordant = by_problem(runs, reference, roles)
    truncated = truncated_share([*runs, *reference], roles)
    points = 100 * _mean(differences)
    ci = bootstrap(differences, rule)
    needed = _problems_for(differences, rule.tolerance_points)
    reason = _refusal(roles, differences, truncated, ci, rule)
    admitted = reason is None
    if reason is None:
        reason = f"{points:+.1f} points (95% {ci[0]:+.1f} to {ci[1]:+.1f}) on {len(differences)} problems"
    return Decision(
        config, admitted, reason, points, ci, len(differences), discordant, accuracy, roles,
        truncated, loaded_share(runs), needed, judge_consistency(runs, reference),
        agent5_ttft(runs),
    )  # fmt: skip


def _refusal(
    roles: Sequence[str], differences: Sequence[float], truncated: float,
    ci: tuple[float, float], rule: YardstickRule,
) -> str | None:  # fmt: skip
    if not roles:
        return "no graded role has recompute's accuracy inside the band: nothing to grade on"
    if len(differences) < rule.min_problems:
        return f"{len(differences)} problems graded < {rule.min_problems}"
    if truncated > rule.max_truncated_share:
        return f"{100 * truncated:.0f}% of graded answers hit the token cap"
    if ci[0] < -rule.tolerance_points:
        return f"may lose more than {rule.tolerance_points:g} points (95% from {ci[0]:+.1f})"
    return None


def recompute_accuracy(reference: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each graded role's share right in recompute's runs (the judge: where gradable)."""
    pairs = role_pairs(reference, reference)
    return {role: sum(a for a, _ in p) / len(p) for role, p in pairs.items() if p}


def by_problem(
    runs: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]],
    roles: Sequence[str],
) -> tuple[list[float], int]:  # fmt: skip
    """Per problem with a graded answer, the mean over its graded roles of (right here −
    right with recompute); and how many graded answers differ."""
    differences, discordant = [], 0
    for run, ref in zip(runs, reference, strict=True):
        cells = [
            int(run["right"][role]) - int(ref["right"][role]) for role in roles
            if role != JUDGE_ROLE or ref.get("judge_graded", True)
        ]  # fmt: skip
        if cells:
            differences.append(sum(cells) / len(cells))
            discordant += sum(c != 0 for c in cells)
    return differences, discordant


def bootstrap(differences: Sequence[float], rule: YardstickRule) -> tuple[float, float]:
    """The percentile interval in points of the mean difference, problems resampled."""
    if not differences:
        return -100.0, 100.0
    import numpy as np

    values = np.asarray(differences, dtype=np.float64)
    rng = np.random.default_rng(rule.seed)
    picks = rng.integers(0, len(values), size=(rule.resamples, len(values)))
    means = values[picks].mean(axis=1)
    tail = (1 - rule.level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return 100 * float(low), 100 * float(high)


def judge_consistency(
    runs: Sequence[Mapping[str, Any]], reference: Sequence[Mapping[str, Any]]
) -> float | None:
    """JCR against recompute's judge: where its judge was gradable, the share of problems
    whose judge gave the same answer (a letter, a number, PASS/FAIL) as recompute's."""
    pairs = [
        (run.get("judge_verdict"), ref.get("judge_verdict"))
        for run, ref in zip(runs, reference, strict=True) if ref.get("judge_graded", True)
    ]  # fmt: skip
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def truncated_share(runs: Sequence[Mapping[str, Any]], roles: Sequence[str]) -> float:
    """The share of graded roles' answers that hit the token cap."""
    flags = [bool(run.get("truncated", {}).get(role, False)) for run in runs for role in roles]
    return sum(flags) / len(flags) if flags else 0.0


def loaded_share(runs: Sequence[Mapping[str, Any]]) -> float | None:
    """Prompt tokens of agents 2–5 loaded from outside the engine, over their prompts."""
    loaded = sum(sum(run.get("cached_tokens", [])[1:]) for run in runs)
    prompts = sum(sum(run.get("prompt_tokens", [])[1:]) for run in runs)
    return loaded / prompts if prompts else None


def _problems_for(differences: Sequence[float], tolerance_points: float) -> int | None:
    """Problems for a 95% half-width of `tolerance_points` at this spread (normal approx.)."""
    if len(differences) < 2:
        return None
    mean = _mean(differences)
    var = sum((d - mean) ** 2 for d in differences) / (len(differences) - 1)
    return max(1, math.ceil((1.96 * 100 * math.sqrt(var) / tolerance_points) ** 2))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def config_name(label: str, labels: Sequence[str]) -> str:
    """A configuration's name in decisions: its label without "(apc on)" when unique."""
    name = label.split(" (")[0]
    return name if sum(other.split(" (")[0] == name for other in labels) == 1 else label


def decisions(pooled: Mapping[str, Any], rule: YardstickRule) -> list[Decision]:
    """Every configuration graded beside recompute (`graded.pool`'s shape)."""
    rows = {row["label"]: row["graded"]["runs"] for row in pooled["configs"]}
    if REFERENCE not in rows:
        raise ValueError("no recompute runs to pair the graded answers with")
    labels = [label for label in rows if label != REFERENCE]
    return [
        decide(config_name(label, labels), rows[label], rows[REFERENCE], rule) for label in labels
    ]


def sensitivity(found: Sequence[Decision], rule: YardstickRule) -> str | None:
    """Why these runs cannot admit a mode (None: every control refused, exact admitted)."""
    by_config = {d.config: d for d in found}
    for name in (*rule.must_refuse, *rule.must_admit):
        if name not in by_config:
            return f"{name} was not graded in these runs"
    admitted = [name for name in rule.must_refuse if by_config[name].admitted]
    if admitted:
        return f"the yardstick is not sensitive: it admits the damaged {', '.join(admitted)}"
    refused = [name for name in rule.must_admit if not by_config[name].admitted]
    if refused:
        return f"the yardstick refuses {', '.join(refused)}: {by_config[refused[0]].reason}"
    return None


def rule_commit(path: Path = RULE_PATH) -> tuple[str, datetime] | None:
    """The commit that last changed the rule file's content and its time (None: not committed
    as it is now, or not in a git checkout). A commit that only moved the file (a rename with
    the same content) fixed nothing: the rule dates from the change before it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=path.parent, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        if git("status", "--porcelain", "--", path.name):
            return None
        found = git("log", "--follow", "--raw", "--format=%x00%H %cI", "--", path.name)
    except (OSError, subprocess.CalledProcessError):
        return None
    for entry in found.split("\0")[1:]:
        head, *lines = entry.strip().splitlines()
        changes = [line for line in lines if line]
        if not changes or not all(_is_pure_move(change) for change in changes):
            commit, when = head.split(" ", 1)
            return commit, datetime.fromisoformat(when)
    return None


def _is_pure_move(raw: str) -> bool:
    """A `git log --raw` line of a rename with identical content (`R100`)."""
    fields = raw.split("\t", 1)[0].split()
    return len(fields) == 5 and fields[2] == fields[3] and fields[4] == "R100"
