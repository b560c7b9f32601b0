"""The admission policy: which reuse modes a model may run, with which parameters (`policy.json`).

Owns `AdmissionPolicy` (frozen, one per model fingerprint), its JSON form and
`load_policy`/`save_policy`. Without a policy only `dense` and `exact` (zero
drift) are admitted. Measuring drift and choosing parameters is `calibrate`'s
job; turning parameters into policies is `client.modes.registry.make_policy`'s.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvsplice.client.modes.base import ReusePolicy
from kvsplice.client.modes.gated import JudgePricing
from kvsplice.client.modes.params import from_json as params_from_json
from kvsplice.client.modes.params import to_json as params_json
from kvsplice.client.modes.registry import MODES, SAFE_MODES, make_policy, mode_spec
from kvsplice.client.modes.route_cost import CostModel
from kvsplice.common.errors import FingerprintMismatch, KvspliceError
from kvsplice.common.keys import is_fingerprint
from kvsplice.common.reuse_modes import (
    EXACT,
    POLICY_FORMAT_VERSION,
    check_fingerprint,
    read_policy_document,
    shipped_policy_path,
)

logger = logging.getLogger(__name__)


class ModeNotAdmitted(KvspliceError):
    """A reuse mode the model's admission policy does not admit was asked for."""

    status_name = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class ModeDrift:
    """What calibration measured for one mode against dense prefill of the same prompts."""

    kl_mean_nats: float
    kl_p95_nats: float
    first_token_agreement: float
    num_calls: int

    def __post_init__(self) -> None:
        for name in ("kl_mean_nats", "kl_p95_nats"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} {value!r} must be finite and >= 0")
        if not 0 <= self.first_token_agreement <= 1:
            raise ValueError(f"first_token_agreement {self.first_token_agreement} not in [0, 1]")
        if self.num_calls < 0:
            raise ValueError(f"num_calls {self.num_calls} < 0")


@dataclass(frozen=True)
class JudgeDrift:
    """What calibration's judge probes measured for a mode admitted for judges (its guard on).

    jcr: share of probe judges selecting what the dense judge selects; reuse: share of
    their candidate blocks' token·layers not computed; kept: per pass (cheapest first),
    the share of the probes reaching it that it kept (empty: not measured).
    """

    jcr: float
    reuse: float
    num_probes: int
    kept: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("jcr", "reuse"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} {getattr(self, name)} not in [0, 1]")
        if self.num_probes < 0:
            raise ValueError(f"num_probes {self.num_probes} < 0")
        object.__setattr__(self, "kept", tuple(float(k) for k in self.kept))
        if any(not 0 <= k <= 1 for k in self.kept):
            raise ValueError(f"kept {self.kept} not in [0, 1]")


@dataclass(frozen=True)
class GradedAccuracy:
    """What graded answers measured for a mode against recompute (dense prefill) on the same
    problems: the paired counts over every graded answer (`both` right, right only with the
    mode, right only with recompute, `neither`), the difference in points with its 95%
    interval, the problems graded (a held-out run must grade others), the tolerance in points
    the mode was judged against, and the workload the answers came from."""

    both: int
    mode_only: int
    recompute_only: int
    neither: int
    points: float
    ci95_points: tuple[float, float]
    problems: tuple[str, ...]
    tolerance_points: float
    workload: str

    def __post_init__(self) -> None:
        counts = (self.both, self.mode_only, self.recompute_only, self.neither)
        if min(counts) < 0:
            raise ValueError(f"graded counts {counts} must be >= 0")
        low, high = (float(x) for x in self.ci95_points)
        if not low <= self.points <= high:
            raise ValueError(f"points {self.points} outside its interval {(low, high)}")
        if not (math.isfinite(self.tolerance_points) and self.tolerance_points >= 0):
            raise ValueError(f"tolerance_points {self.tolerance_points!r} must be >= 0")
        object.__setattr__(self, "ci95_points", (low, high))
        object.__setattr__(self, "problems", tuple(str(p) for p in self.problems))

    @property
    def num_answers(self) -> int:
        return self.both + self.mode_only + self.recompute_only + self.neither


@dataclass(frozen=True)
class AdmissionPolicy:
    """Admitted modes and their parameters for the model `model_fingerprint`.

    params: mode → its `Params` (a mode absent takes its defaults). created_at:
    ISO 8601 time of calibration (None: built in); drift: what calibration measured.
    judge_modes: the admitted modes calibration also admitted for judge-like calls
    (interaction-preserving ones; the risk gate sends judges nowhere else but
    dense/exact), best first; judge_drift: what its judge probes measured. cost: the
    measured cost model the risk gate prices judge routes with (None: not measured, the
    gate sends judges to the admitted judge mode unpriced). graded: mode → what graded
    answers measured for it (older engine policies). decisions: the graded yardstick's
    verdict per configuration graded (`kvsplice bench vllm-graded --admit`), and yardstick:
    its workload, rule and commit, and why no mode was admitted (None: not from it).
    """

    model_fingerprint: str
    admitted_modes: tuple[str, ...] = SAFE_MODES
    params: Mapping[str, Any] = field(default_factory=dict)
    created_at: str | None = None
    drift: Mapping[str, ModeDrift] = field(default_factory=dict)
    judge_modes: tuple[str, ...] = ()
    judge_drift: Mapping[str, JudgeDrift] = field(default_factory=dict)
    cost: CostModel | None = None
    graded: Mapping[str, GradedAccuracy] = field(default_factory=dict)
    decisions: tuple[Mapping[str, Any], ...] = ()
    yardstick: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not is_fingerprint(self.model_fingerprint):
            raise ValueError(f"model_fingerprint {self.model_fingerprint!r} is malformed")
        modes = tuple(self.admitted_modes)
        if "dense" not in modes or len(set(modes)) != len(modes):
            raise ValueError(f"admitted_modes {modes} must be distinct and include 'dense'")
        object.__setattr__(self, "admitted_modes", modes)
        for mode, params in self.params.items():
            if not isinstance(params, mode_spec(mode).params_type):
                raise ValueError(f"parameters of {mode!r} are a {type(params).__name__}")
        for mode in self.graded:
            mode_spec(mode)  # graded answers of a mode kvsplice knows
        judges = tuple(self.judge_modes)
        object.__setattr__(self, "judge_modes", judges)
        for mode in judges:
            if mode not in modes or not mode_spec(mode).judge_capable:
                raise ValueError(f"judge mode {mode!r} must be admitted and interaction-preserving")

    @property
    def judge_pricing(self) -> JudgePricing | None:
        """How the gate prices judge routes (None without a measured cost model)."""
        if self.cost is None:
            return None
        if not self.judge_modes:
            return JudgePricing(self.cost)
        mode = self.judge_modes[0]
        params = self.params_of(mode)
        checks = tuple(getattr(params, "check_layers", ()))
        drift = self.judge_drift.get(mode)
        ratio = float(getattr(params, "ratio", 0.0))
        question = bool(getattr(params, "question", 0))
        return JudgePricing(self.cost, checks, drift.kept if drift else (), ratio, question)

    def params_of(self, mode: str) -> Any:
        """`mode`'s parameters: this policy's, or the mode's defaults."""
        return self.params.get(mode) or mode_spec(mode).params_type()

    def with_params(self, mode: str, params: Any) -> AdmissionPolicy:
        """This policy with `mode`'s parameters replaced."""
        return replace(self, params={**self.params, mode: params})

    def admits(self, mode: str) -> bool:
        """Admitted, or a mode that only routes to admitted ones (`gated`)."""
        return mode in self.admitted_modes or (mode in MODES and mode_spec(mode).routes)

    @property
    def serving_mode(self) -> str:
        """What `gated` runs for ordinary calls: the first admitted approximate mode that
        is not only a judge mode, else `exact`."""
        for mode in self.admitted_modes:
            spec = mode_spec(mode)
            ordinary = spec.drifts and not spec.routes and not spec.ablation
            if ordinary and mode not in self.judge_modes:
                return mode
        return EXACT

    def policy_of(self, mode: str) -> ReusePolicy:
        """`mode`'s policy with this policy's parameters (a routing mode: over this policy)."""
        spec = mode_spec(mode)
        if spec.route is not None:
            return spec.route(self)
        return make_policy(mode, self.params_of(mode))

    def check(self, fingerprint: str, mode: str) -> None:
        """Raise unless this policy is `fingerprint`'s and admits `mode`."""
        if fingerprint != self.model_fingerprint:
            raise FingerprintMismatch(
                f"admission policy is for model {self.model_fingerprint}, not {fingerprint}"
            )
        if not self.admits(mode):
            raise ModeNotAdmitted(
                f"mode {mode!r} is not admitted for {fingerprint} "
                f"(admitted: {', '.join(self.admitted_modes)}); calibrate it first"
            )

    def to_json(self) -> str:
        document: dict[str, Any] = {
            "format_version": POLICY_FORMAT_VERSION,
            "model_fingerprint": self.model_fingerprint,
            "admitted_modes": list(self.admitted_modes),
            "params": {mode: params_json(p) for mode, p in sorted(self.params.items())},
            "created_at": self.created_at,
            "drift": {mode: asdict(d) for mode, d in sorted(self.drift.items())},
            "judge_modes": list(self.judge_modes),
            "judge_drift": {mode: asdict(d) for mode, d in sorted(self.judge_drift.items())},
            "cost": None if self.cost is None else asdict(self.cost),
            "graded": {mode: asdict(g) for mode, g in sorted(self.graded.items())},
        }
        if self.yardstick is not None:  # the graded yardstick's (absent from other policies)
            document["decisions"] = [dict(d) for d in self.decisions]
            document["yardstick"] = dict(self.yardstick)
        return json.dumps(document, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> AdmissionPolicy:
        """Parse `to_json`'s output (or a version-1 file); ValueError naming what is wrong."""
        document = read_policy_document(text)
        try:
            drift = {m: ModeDrift(**d) for m, d in document["drift"].items()}
            params = {
                m: params_from_json(mode_spec(m).params_type, p)
                for m, p in document["params"].items()
            }
            modes = tuple(str(m) for m in document["admitted_modes"])
            # judge admission came later within version 2: absent means none
            judges = tuple(str(m) for m in document.get("judge_modes", ()))
            judge_drift = {m: JudgeDrift(**d) for m, d in document.get("judge_drift", {}).items()}
            cost = document.get("cost")  # absent: not measured (older files)
            graded = {m: GradedAccuracy(**g) for m, g in document.get("graded", {}).items()}
            decisions = tuple(dict(d) for d in document.get("decisions", ()))
            return cls(
                document["model_fingerprint"], modes, params, document["created_at"], drift,
                judges, judge_drift, None if cost is None else CostModel(**cost), graded,
                decisions, document.get("yardstick"),
            )  # fmt: skip
        except (KeyError, TypeError) as error:
            raise ValueError(f"malformed admission policy: {error!r}") from error


def default_policy(fingerprint: str) -> AdmissionPolicy:
    """The safe default: only `dense` and `exact`, which never drift from dense prefill."""
    return AdmissionPolicy(model_fingerprint=fingerprint)


def shipped_policy(fingerprint: str) -> AdmissionPolicy | None:
    """The policy the package ships for the model `fingerprint` (None: none ships)."""
    path = shipped_policy_path(fingerprint)
    return AdmissionPolicy.from_json(path.read_text()) if path is not None else None


def load_policy(path: Path | str | None, fingerprint: str) -> AdmissionPolicy:
    """The policy at `path` for the model `fingerprint`; when `path` is None, the policy the
    package ships for that model, else the safe default.

    Raises FingerprintMismatch for a policy calibrated on another model, and
    FileNotFoundError for a path that does not exist (a named policy that is
    missing is a deployment error, not a reason to run with defaults).
    """
    if path is None:
        return shipped_policy(fingerprint) or default_policy(fingerprint)
    policy = AdmissionPolicy.from_json(Path(path).read_text())
    check_fingerprint({"model_fingerprint": policy.model_fingerprint}, fingerprint,
                      f"admission policy {path}")  # fmt: skip
    logger.info("admission policy %s admits %s", path, ", ".join(policy.admitted_modes))
    return policy


def save_policy(policy: AdmissionPolicy, path: Path | str) -> None:
    """Write `policy` as JSON, atomically (a reader never sees half a file)."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(policy.to_json())
    os.replace(partial, target)
