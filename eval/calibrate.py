"""`kvsplice calibrate`: measure each reuse mode's drift per parameter, admit what passes.

Owns `CalibrationConfig`, the selection rule (`select`, `build_policy`), the
run (`run_calibration`), its table and `write_policy`. Probing one candidate is
`calibrate_probes`'s job; loading and enforcing the policy is `client.admission`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from rich.table import Table

from kvsplice.agents.graph import fully_connected
from kvsplice.agents.pipeline import AgentCall
from kvsplice.client.admission import SAFE_MODES, AdmissionPolicy, save_policy
from kvsplice.client.models import LoadedModel, ModelConfig, load_model
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.eval.calibrate_probes import (
    W_EXACT_TABLES,
    Candidate,
    Measurement,
    candidate_grid,
    measure_candidate,
)
from kvsplice.eval.fidelity import DenseReferences
from kvsplice.eval.workload_math import MathWorkload
from kvsplice.eval.workload_types import Workload

logger = logging.getLogger(__name__)

ProgressFn = Callable[[str], None]
COLUMNS = ("mode", "parameter", "token reuse", "token·layer reuse", "approx reuse", "KL mean", "KL p95", "agreement", "admitted")  # fmt: skip


@dataclass(frozen=True)
class Thresholds:
    """A parameter passes when mean KL ≤ max_mean_kl and agreement ≥ min_first_token_agreement."""

    max_mean_kl: float = 0.05
    min_first_token_agreement: float = 0.95

    def __post_init__(self) -> None:
        if not self.max_mean_kl >= 0:
            raise ValueError(f"max_mean_kl {self.max_mean_kl} must be >= 0")
        if not 0 <= self.min_first_token_agreement <= 1:
            raise ValueError(
                f"min_first_token_agreement {self.min_first_token_agreement} not in [0, 1]"
            )

    def passes(self, measurement: Measurement) -> bool:
        """Within both bounds (inclusive), and the approximation was exercised.

        A mode that only ever reused the exact prefix on the probes (say, every
        anchor gate fell back to dense) has drift 0 that says nothing about it.
        """
        return (
            measurement.num_calls > 0
            and measurement.approx_reuse > 0
            and measurement.kl_mean_nats <= self.max_mean_kl
            and measurement.first_token_agreement >= self.min_first_token_agreement
        )


@dataclass(frozen=True)
class CalibrationConfig:
    """probes: questions of the math workload run through `num_agents` fully connected agents.

    At least 3 probes for `anchor` to be measured at all: a placeholder's first
    two samples only fill its pool (the gate needs two anchors to compare).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    probes: int = 4
    num_agents: int = 3
    max_new_tokens: int = 8
    blend_ratios: tuple[float, ...] = (0.15, 0.3, 0.5)
    halo_tokens: tuple[int, ...] = (2, 4, 8)
    anchor_gammas: tuple[float, ...] = (0.3, 0.5, 1.0)
    anchor_repairs: tuple[float, ...] = (0.15,)
    w_exact_tables: tuple[str, ...] = tuple(W_EXACT_TABLES)
    thresholds: Thresholds = field(default_factory=Thresholds)
    namespace: str = "kvsplice-calibrate"

    def __post_init__(self) -> None:
        for name in ("probes", "num_agents", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        unknown = [t for t in self.w_exact_tables if t not in W_EXACT_TABLES]
        if unknown:
            raise ValueError(f"w_exact_tables {unknown} not in {tuple(W_EXACT_TABLES)}")

    def candidates(self) -> list[Candidate]:
        return candidate_grid(
            self.blend_ratios, self.halo_tokens, self.anchor_gammas, self.w_exact_tables,
            self.anchor_repairs,
        )  # fmt: skip


@dataclass(frozen=True)
class CalibrationResult:
    """Every measurement, the parameter chosen per admitted mode, and the policy they make."""

    measurements: tuple[Measurement, ...]
    chosen: Mapping[str, Measurement]
    thresholds: Thresholds
    policy: AdmissionPolicy


def select(measurements: Sequence[Measurement], thresholds: Thresholds) -> dict[str, Measurement]:
    """Per mode, the passing measurement that saves most compute; modes with none are absent.

    Most compute: token-layer reuse, then token reuse, then the parameter's rank.
    """
    chosen: dict[str, Measurement] = {}
    for m in measurements:
        if thresholds.passes(m) and (m.mode not in chosen or _saving(m) > _saving(chosen[m.mode])):
            chosen[m.mode] = m
    return chosen


def build_policy(
    fingerprint: str, chosen: Mapping[str, Measurement], created_at: str | None = None
) -> AdmissionPolicy:
    """dense and exact, plus every chosen mode with its parameter and measured drift."""
    modes = SAFE_MODES + tuple(m for m in chosen if m not in SAFE_MODES)
    policy = AdmissionPolicy(
        fingerprint,
        admitted_modes=modes,
        created_at=created_at,
        drift={mode: m.drift() for mode, m in chosen.items()},
    )
    for measurement in chosen.values():
        policy = replace(policy, **measurement.candidate.overrides)
    return policy


def run_calibration(
    config: CalibrationConfig,
    progress: ProgressFn | None = None,
    *,
    loaded: LoadedModel | None = None,
    workload: Workload | None = None,
) -> CalibrationResult:
    """Probe every candidate (one embedded store and namespace each), choose, build the policy."""
    loaded = loaded or load_model(config.model)
    workload = workload or MathWorkload()
    graph = fully_connected(workload.roles(config.num_agents, config.max_new_tokens))
    questions = [p.question for p in workload.problems(config.probes)]
    dense = ReuseEngine(loaded, "dense", None, EngineConfig(store_segments=False))
    references = DenseReferences(dense, "first_token")  # shared: one dense prefill per prompt
    measurements = []
    for index, candidate in enumerate(config.candidates()):
        label = f"{candidate.mode} {candidate.label}"
        namespace = f"{config.namespace}-{index}-{candidate.mode}"
        measurement = measure_candidate(
            loaded,
            candidate,
            graph,
            workload,
            questions,
            references,
            namespace,
            _on_call(progress, label),
        )
        logger.info("calibrate %s: %s", label, measurement)
        measurements.append(measurement)
    chosen = select(measurements, config.thresholds)
    created_at = datetime.now(UTC).isoformat(timespec="seconds")
    policy = build_policy(loaded.fingerprint, chosen, created_at)
    return CalibrationResult(tuple(measurements), chosen, config.thresholds, policy)


def render_calibration(result: CalibrationResult) -> Table:
    """One row per probed (mode, parameter); ✓ marks the parameter admitted for its mode."""
    t = result.thresholds
    bounds = f"mean KL ≤ {t.max_mean_kl} nats, agreement ≥ {t.min_first_token_agreement}"
    table = Table(title=f"calibration (admit: {bounds})")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("mode", "parameter") else "right")
    for m in result.measurements:
        admitted = "✓" if result.chosen.get(m.mode) is m else ("pass" if t.passes(m) else "✗")
        table.add_row(
            m.mode, m.candidate.label, f"{m.token_reuse:.1%}", f"{m.token_layer_reuse:.1%}", f"{m.approx_reuse:.1%}",
            f"{m.kl_mean_nats:.4f}", f"{m.kl_p95_nats:.4f}", f"{m.first_token_agreement:.0%}", admitted,
        )  # fmt: skip
    return table


def write_policy(result: CalibrationResult, path: Path | str) -> None:
    """Write the calibrated admission policy to `path` (atomically)."""
    save_policy(result.policy, path)
    logger.info("admission policy %s admits %s", path, ", ".join(result.policy.admitted_modes))


def _saving(m: Measurement) -> tuple[float, float, int]:
    return (m.token_layer_reuse, m.token_reuse, m.candidate.rank)


def _on_call(progress: ProgressFn | None, label: str) -> Callable[[AgentCall], None] | None:
    if progress is None:
        return None
    return lambda call: progress(f"{label} · agent {call.agent_id}")
