"""Calibration probes: the candidate (mode, parameter) grid and one candidate's measured drift.

Owns `Candidate` (a mode with admission-policy overrides), `Measurement` and
`measure_candidate` (the probe questions through the agent pipeline on a fresh
embedded store, each call compared with dense prefill). Choosing is `calibrate`'s job.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from kvsplice.agents.graph import AgentGraph
from kvsplice.agents.pipeline import AgentCall, run_pipeline
from kvsplice.client.admission import AdmissionPolicy, ModeDrift
from kvsplice.client.models import LoadedModel
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.client.store_client import StoreClient
from kvsplice.eval.fidelity import DenseReferences, compare
from kvsplice.eval.store_session import open_store
from kvsplice.eval.workload_types import Workload

logger = logging.getLogger(__name__)

# multicut W_exact guard tables, from most to least left context demanded
W_EXACT_TABLES: dict[str, tuple[tuple[int, int | str], ...]] = {
    "conservative": ((4, 32), (8, 128)),
    "default": ((4, 8), (8, 32), (12, 128)),
    "permissive": ((4, 4), (8, 16), (16, 64), (24, 128)),
}


@dataclass(frozen=True)
class Candidate:
    """One mode with one parameter: `overrides` are `AdmissionPolicy` fields.

    rank: how aggressive the parameter is within its mode (higher saves more
    compute by construction); it breaks ties between equal measured reuse.
    """

    mode: str
    label: str
    overrides: Mapping[str, object] = field(default_factory=dict)
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


def candidate_grid(
    blend_ratios: Sequence[float],
    halo_tokens: Sequence[int],
    anchor_gammas: Sequence[float],
    w_exact_tables: Sequence[str],
    anchor_repairs: Sequence[float] = (),
) -> list[Candidate]:
    """Every (mode, parameter) to probe; ranks: smaller r / h, larger γ, later table save more.

    anchor_repairs: CacheBlend ratios on the corrected K/V, each probed with the
    largest γ (a repaired correction is meant to be used whenever a pool exists);
    they rank below every unrepaired γ, and a smaller ratio above a larger one.
    """
    grid = [Candidate("naive", "-")]
    grid += [
        Candidate("anchor", f"γ={g}", {"anchor_gamma": g}, i)
        for i, g in enumerate(sorted(anchor_gammas))
    ]
    if anchor_gammas:
        gamma = max(anchor_gammas)
        grid += [
            Candidate(
                "anchor", f"γ={gamma} r={r}", {"anchor_gamma": gamma, "anchor_repair_ratio": r},
                -1 - i,
            )
            for i, r in enumerate(sorted(anchor_repairs))
        ]  # fmt: skip
    grid += [
        Candidate("multicut", t, {"w_exact": W_EXACT_TABLES[t]}, list(W_EXACT_TABLES).index(t))
        for t in w_exact_tables
    ]
    grid += [
        Candidate("blend", f"r={r}", {"blend_ratio": r}, -i)
        for i, r in enumerate(sorted(blend_ratios))
    ]
    grid += [
        Candidate("halo", f"h={h}", {"halo_tokens": h}, -i)
        for i, h in enumerate(sorted(halo_tokens))
    ]
    return grid


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
    admission = replace(
        AdmissionPolicy(loaded.fingerprint, admitted_modes=("dense", candidate.mode)),
        **candidate.overrides,
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
            references.get(call.prompt, call.generation), call.first_token_logits, call.output_ids
        )
        kls.append(fidelity.kl_dense_reuse)
        agreements.append(fidelity.first_token_agrees)
    prompt_tokens = sum(c.num_prompt_tokens for c in calls) or 1
    layer_tokens = sum(s.num_tokens * s.num_layers for c in calls for s in c.reused_spans)
    approx_tokens = sum(s.num_tokens for c in calls for s in c.reused_spans if not s.exact)
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
