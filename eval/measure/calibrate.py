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
from kvsplice.client.model.models import LoadedModel, ModelConfig, load_model
from kvsplice.client.modes.admission import AdmissionPolicy, JudgeDrift, save_policy
from kvsplice.client.modes.params import knobs
from kvsplice.client.modes.registry import (
    CALIBRATED_MODES,
    JUDGE_CAPABLE_MODES,
    SAFE_MODES,
    mode_spec,
)
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.eval.bench.mode_variants import ModeVariant
from kvsplice.eval.bench.store_session import open_store
from kvsplice.eval.measure.calibrate_probes import (
    Candidate,
    Measurement,
    candidate_grid,
    measure_candidate,
)
from kvsplice.eval.measure.fidelity import DenseReferences
from kvsplice.eval.measure.judge_probes import JudgeProbe, JudgeThresholds, probe_judge_modes
from kvsplice.eval.measure.route_costs import measure_cost_model
from kvsplice.eval.report.tables import figures_table
from kvsplice.eval.workloads.judge_examples import JUDGE_SAMPLE, JudgeExample, load_judge_data
from kvsplice.eval.workloads.math_problems import MathWorkload
from kvsplice.eval.workloads.workload import Workload

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

    modes: the modes to probe, each over its knobs' grids; grid: the candidates
    instead (a reduced run).

    At least 3 probes for `anchor` to be measured at all: a placeholder's first
    two samples only fill its pool (the gate needs two anchors to compare).

    Judge probes (the first `judge_probes` examples of `judge_data` — a `bench judge
    --data` file, the shipped judge sample by default — × `judge_seeds` shuffled orders;
    0: none) try each judge mode's grid and admit it for judges when its held-out guarded JCR
    clears `judge_thresholds` (`eval.measure.judge_probes`); `judge_variant` (e.g. "q=1")
    sets parameters of every judge candidate, two-pass ones included. `cost_model`: also time the
    judge routes' cost model (`eval.measure.route_costs`), which the risk gate prices with.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    probes: int = 4
    num_agents: int = 3
    max_new_tokens: int = 8
    modes: tuple[str, ...] = CALIBRATED_MODES
    grid: tuple[Candidate, ...] | None = None
    thresholds: Thresholds = field(default_factory=Thresholds)
    namespace: str = "kvsplice-calibrate"
    judge_probes: int = 6
    judge_seeds: tuple[int, ...] = (0, 1)
    judge_data: Path = JUDGE_SAMPLE
    judge_modes: tuple[str, ...] = JUDGE_CAPABLE_MODES
    judge_thresholds: JudgeThresholds = field(default_factory=JudgeThresholds)
    judge_variant: str = ""
    cost_model: bool = True

    def __post_init__(self) -> None:
        for name in ("probes", "num_agents", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)} must be >= 1")
        for mode in self.modes:
            mode_spec(mode)  # ValueError naming the known modes
        for mode in self.judge_modes:
            if not mode_spec(mode).judge_capable:
                raise ValueError(f"mode {mode!r} cannot serve judges")
        if self.judge_probes < 0 or (self.judge_probes and not self.judge_seeds):
            raise ValueError("judge_probes must be >= 0, with at least one seed")
        for mode, spec in self.judge_candidates():
            ModeVariant.parse(spec).apply(mode_spec(mode).params_type())  # names the bad one

    def judge_candidates(self) -> list[tuple[str, str]]:
        """(mode, variant spec) per value of each judge mode's grids, its guard off."""
        candidates = []
        extra = f"+{self.judge_variant}" if self.judge_variant else ""
        for mode in self.judge_modes:
            all_knobs = knobs(mode_spec(mode).params_type)
            for spec in all_knobs.values():
                fixed = "".join(f"+{all_knobs[f].name}={v}" for f, v in spec.grid_with.items())
                candidates += [
                    (mode, f"{mode}:{spec.name}={value}{fixed}{extra}+margin=0")
                    for value in spec.grid
                ]
        return candidates

    def candidates(self) -> list[Candidate]:
        """`grid`, or each mode's knob grids (`client.modes.params.Knob.grid`)."""
        return candidate_grid(self.modes) if self.grid is None else list(self.grid)


@dataclass(frozen=True)
class CalibrationResult:
    """Every measurement, the parameter chosen per admitted mode, and the policy they make."""

    measurements: tuple[Measurement, ...]
    chosen: Mapping[str, Measurement]
    thresholds: Thresholds
    policy: AdmissionPolicy
    judge_probes: tuple[JudgeProbe, ...] = ()


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
    fingerprint: str,
    chosen: Mapping[str, Measurement],
    created_at: str | None = None,
    judges: Sequence[JudgeProbe] = (),
) -> AdmissionPolicy:
    """dense and exact, plus every chosen mode with its parameter and measured drift, plus
    the judge mode admitted for judges that reused most on the judge probes (its guard set)."""
    modes = SAFE_MODES + tuple(m for m in chosen if m not in SAFE_MODES)
    policy = AdmissionPolicy(
        fingerprint,
        admitted_modes=modes,
        created_at=created_at,
        drift={mode: m.drift() for mode, m in chosen.items()},
    )
    for mode, measurement in chosen.items():
        policy = policy.with_params(mode, measurement.candidate.params)
    best = select_judge(judges)
    if best is None:
        return policy
    params = replace(ModeVariant.parse(best.spec).apply(policy.params_of(best.mode)),
                     min_margin=best.min_margin)  # fmt: skip
    admitted = policy.admitted_modes + (() if best.mode in modes else (best.mode,))
    return replace(
        policy.with_params(best.mode, params), admitted_modes=admitted, judge_modes=(best.mode,),
        judge_drift={best.mode: JudgeDrift(best.jcr, best.reuse, best.num_probes, best.pass_kept)},
    )  # fmt: skip


def select_judge(probes: Sequence[JudgeProbe]) -> JudgeProbe | None:
    """The admitted judge probe that reused most (None: none admitted); on a tie, the one
    whose cheapest pass reuses most when it keeps a call (a staged one over its deep pass
    alone: the probes are close calls, which only the deep pass keeps)."""
    admitted = [p for p in probes if p.admitted]
    return max(admitted, key=lambda p: (p.reuse, p.jcr, p.ceiling), default=None)


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
    judges = _judge_probes(config, loaded, progress)
    chosen = select(measurements, config.thresholds)
    created_at = datetime.now(UTC).isoformat(timespec="seconds")
    policy = build_policy(loaded.fingerprint, chosen, created_at, judges)
    if config.cost_model:
        with open_store(None) as store:
            policy = replace(policy, cost=measure_cost_model(loaded, store.target))
    return CalibrationResult(tuple(measurements), chosen, config.thresholds, policy, tuple(judges))


def judge_examples(config: CalibrationConfig) -> list[JudgeExample]:
    """The judge probes' candidate sets: the first `judge_probes` of `judge_data`
    (`ValueError` naming the file and line of a malformed one)."""
    return load_judge_data(config.judge_data)[: config.judge_probes]


def _judge_probes(
    config: CalibrationConfig, loaded: LoadedModel, progress: ProgressFn | None
) -> list[JudgeProbe]:
    candidates = config.judge_candidates()
    if not config.judge_probes or not candidates:
        return []
    examples = judge_examples(config)
    with open_store(None) as store:
        return probe_judge_modes(
            loaded, candidates, examples, config.judge_seeds, store.target,
            config.judge_thresholds, progress,
        )  # fmt: skip


def render_calibration(result: CalibrationResult) -> Table:
    """One row per probed (mode, parameter); ✓ marks the parameter admitted for its mode."""
    t = result.thresholds
    bounds = f"mean KL ≤ {t.max_mean_kl} nats, agreement ≥ {t.min_first_token_agreement}"
    table = figures_table(COLUMNS, ("mode", "parameter"), title=f"calibration (admit: {bounds})")
    for m in result.measurements:
        admitted = "✓" if result.chosen.get(m.mode) is m else ("pass" if t.passes(m) else "✗")
        table.add_row(
            m.mode, m.candidate.label, f"{m.token_reuse:.1%}", f"{m.token_layer_reuse:.1%}", f"{m.approx_reuse:.1%}",
            f"{m.kl_mean_nats:.4f}", f"{m.kl_p95_nats:.4f}", f"{m.first_token_agreement:.0%}", admitted,
        )  # fmt: skip
    return table


JUDGE_COLUMNS = ("mode", "candidate (guard off)", "probes", "JCR unguarded", "max error", "guard margin", "JCR guarded, held out", "kept", "cand. token·layer reuse", "admitted")  # fmt: skip


def render_judge_probes(result: CalibrationResult) -> Table:
    """One row per judge-mode candidate; ✓ marks the one admitted for judges."""
    labels = [c for c in JUDGE_COLUMNS if c.startswith(("mode", "cand"))]
    title = "judge probes (admit for judges: held-out guarded JCR ≥ bar, some reuse)"
    table = figures_table(JUDGE_COLUMNS, labels, title=title)
    best = select_judge(result.judge_probes)
    for p in result.judge_probes:
        admitted = "✓" if p is best else ("pass" if p.admitted else "✗")
        table.add_row(
            p.mode, p.spec, str(p.num_probes), f"{p.raw_jcr:.0%}", f"{p.max_error:.2f}",
            f"{p.min_margin:.2f}", f"{p.jcr:.0%}", f"{p.kept:.0%}", f"{p.reuse:.1%}", admitted,
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
