"""Calibration probes: the candidate (mode, parameter) grid and one candidate's measured drift.

Owns `Candidate` (a mode with one point of its knobs' calibration grids), `Measurement` and
`measure_candidate` (the probe questions through the agent pipeline on a fresh
embedded store, each call compared with dense prefill). Choosing is `calibrate`'s job.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvsplice.agents.graph import AgentGraph
from kvsplice.agents.pipeline import AgentCall, run_pipeline
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.admission import AdmissionPolicy, ModeDrift
from kvsplice.client.modes.params import knobs
from kvsplice.client.modes.registry import CALIBRATED_MODES, mode_spec
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.eval.bench.store_session import open_store
from kvsplice.eval.measure.fidelity import DenseReferences, compare
from kvsplice.eval.workloads.workload import Workload
from kvsplice.storeclient.client import StoreClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One mode with one point of its calibration grid: `params` are the mode's `Params`.

    rank: how aggressive the parameter is within its mode (higher saves more
    compute by construction); it breaks ties between equal measured reuse.
    """

    mode: str
    label: str
    params: Any
    rank: int = 0


@dataclass(frozen=True)
class Measurement:
    """One candidate's drift against dense over its probe calls, and the compute it saved.

    token_reuse: reused / prompt tokens; token_layer_reuse: reused (token, layer)
    pairs / (prompt tokens × layers); approx_reuse: tokens reused by the mode's
    approximation (not exact-prefix reuse) / prompt tokens; all over all calls.
    """

    candidate: Candidate
    num_calls: int
    kl_mean_nats: float
    kl_p95_nats: float
    first_token_agreement: float
    token_reuse: float
    token_layer_reuse: float
    approx_reuse: float

    def __post_init__(self) -> None:
        if self.num_calls < 0:
            raise ValueError(f"num_calls {self.num_calls} < 0")
        for name in ("token_reuse", "token_layer_reuse", "approx_reuse", "first_token_agreement"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} {getattr(self, name)} not in [0, 1]")

    @property
    def mode(self) -> str:
        return self.candidate.mode

    def drift(self) -> ModeDrift:
        return ModeDrift(
            self.kl_mean_nats, self.kl_p95_nats, self.first_token_agreement, self.num_calls
        )


def candidate_grid(modes: Sequence[str] | None = None) -> list[Candidate]:
    """Every (mode, parameter) to probe: each knob's grid (`Knob.grid`) with the others at
    their defaults; a mode without grids is probed once with its defaults ("-").

    modes: the modes to probe (default: every mode the registry marks calibrated).
    Ranks follow each grid's order (least to most compute saved); a knob probed
    with others set (`grid_with`, anchor's repair ratio at γ=1) ranks below them.
    """
    grid: list[Candidate] = []
    for mode in CALIBRATED_MODES if modes is None else modes:
        params_type = mode_spec(mode).params_type
        gridded = {name: k for name, k in knobs(params_type).items() if k.grid}
        if not gridded:
            grid.append(Candidate(mode, "-", params_type()))
        for name, spec in gridded.items():
            grid += [_candidate(mode, params_type, name, i) for i in range(len(spec.grid))]
    return grid


def _candidate(mode: str, params_type: type, name: str, index: int) -> Candidate:
    all_knobs = knobs(params_type)
    spec = all_knobs[name]
    fields = {**spec.grid_with, name: spec.grid[index]}
    labels = [all_knobs[f].label(v) for f, v in spec.grid_with.items()]
    label = " ".join([*labels, spec.label(spec.grid[index], index)])
    rank = index - len(spec.grid) if spec.grid_with else index
    return Candidate(mode, label, params_type(**fields), rank)


def measure_candidate(
    loaded: LoadedModel,
    candidate: Candidate,
    graph: AgentGraph,
    workload: Workload,
    questions: Sequence[str],
    references: DenseReferences,
    namespace: str,
    on_call: Callable[[AgentCall], None] | None = None,
) -> Measurement:
    """All `questions` through `graph` in `candidate`'s mode on its own embedded store."""
    admission = AdmissionPolicy(
        loaded.fingerprint,
        admitted_modes=("dense", candidate.mode),
        params={candidate.mode: candidate.params},
    )
    calls: list[AgentCall] = []
    with open_store(None) as session, StoreClient(session.target, namespace) as client:
        engine = ReuseEngine(loaded, candidate.mode, client, EngineConfig(), admission)
        for question in questions:
            trace = run_pipeline(
                graph, question, engine, ignore_stop=workload.ignore_stop, on_call=on_call
            )
            calls += trace.calls
    return summarize(candidate, calls, references, loaded.layout.num_layers)


def summarize(
    candidate: Candidate,
    calls: Sequence[AgentCall],
    references: DenseReferences,
    num_layers: int,
) -> Measurement:
    """Drift of each call's first-token distribution against its dense reference, and reuse."""
    kls, agreements = [], []
    for call in calls:
        fidelity = compare(
            references.get(call.prompt, call.generation), call.logits_first, call.output_ids
        )
        kls.append(fidelity.kl_dense_reuse)
        agreements.append(fidelity.first_token_agrees)
    prompt_tokens = sum(c.num_prompt_tokens for c in calls) or 1
    layer_tokens = sum(s.num_tokens * s.num_layers for c in calls for s in c.reused)
    approx_tokens = sum(s.num_tokens for c in calls for s in c.reused if not s.exact)
    return Measurement(
        candidate=candidate,
        num_calls=len(calls),
        kl_mean_nats=sum(kls) / len(kls) if kls else 0.0,
        kl_p95_nats=percentile(kls, 0.95),
        first_token_agreement=sum(agreements) / len(agreements) if agreements else 0.0,
        token_reuse=sum(c.num_reused_tokens for c in calls) / prompt_tokens,
        token_layer_reuse=min(1.0, layer_tokens / (prompt_tokens * num_layers)),
        approx_reuse=min(1.0, approx_tokens / prompt_tokens),
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile of `values` (0.0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
