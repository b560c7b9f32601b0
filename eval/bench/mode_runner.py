"""Running one workload's problems through the agent pipeline in several mode variants.

Owns the measurement protocol shared by `bench agents` and the demo: one fresh
store namespace per variant (variants never feed each other), one untimed warm-up
sample per variant in its own throwaway namespace, variants interleaved per sample
(dense first) so machine load drifts alike for all, samples in sequence within
a variant (later ones may reuse earlier ones' segments), a dense reference per
reuse call outside its TTFT. Parsing variants, aggregation and reporting are elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass

from kvsplice.agents.graph import AgentGraph, chain, fully_connected
from kvsplice.agents.layouts import DEFAULT_LAYOUT, check_layout
from kvsplice.agents.pipeline import AgentCall, PipelineTrace, run_pipeline
from kvsplice.agents.roles import with_layout
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.admission import AdmissionPolicy
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.common.reuse_modes import DENSE, EXACT, NAIVE
from kvsplice.common.segment import validate_namespace
from kvsplice.eval.bench.mode_variants import ModeVariant
from kvsplice.eval.measure.fidelity import REFERENCE_KINDS, DenseReferences, compare
from kvsplice.eval.measure.metrics import CallRecord
from kvsplice.eval.workloads.workload import Problem, Workload
from kvsplice.kvmath.quant import check_quant
from kvsplice.storeclient.client import StoreClient

logger = logging.getLogger(__name__)

GRAPHS = ("fully_connected", "chain")
WARMUP_MAX_NEW_TOKENS = 8


@dataclass(frozen=True)
class ProgressEvent:
    """`done` of `total` agent calls finished (warm-up calls included); what just ran."""

    done: int
    total: int
    message: str


ProgressFn = Callable[[ProgressEvent], None]


@dataclass(frozen=True)
class ModeRunConfig:
    """How to run the modes. `modes` are variant specs (see `mode_variants`), kept as their
    labels; they must include "dense" (the speedup baseline), which runs first.

    `layout`: where personas, the shared context and answers go in each prompt
    (`agents.layouts.LAYOUTS`); fidelity is always against dense of the same layout.
    `admission`: the base parameters of every variant (None: the defaults); it
    is not an admission check, benchmarks run any mode. `quant` is the stored
    payload scheme ("none" keeps exact mode bit-faithful). `reference`: "full"
    (dense first-token logits and greedy output per reuse call), "first_token"
    (logits only), or "off".
    """

    modes: tuple[str, ...] = (DENSE, EXACT, NAIVE)
    num_agents: int = 3
    graph: str = "fully_connected"
    layout: str = DEFAULT_LAYOUT
    max_new_tokens: int = 64
    quant: str = "none"
    reference: str = "full"
    warmup: bool = True
    namespace: str = "kvsplice-eval"
    store_token: str | None = None
    admission: AdmissionPolicy | None = None

    def __post_init__(self) -> None:
        labels = [ModeVariant.parse(spec).label for spec in self.modes]
        if DENSE not in labels or len(set(labels)) != len(labels):
            raise ValueError(
                f"modes {tuple(labels)} must have distinct labels and include {DENSE!r}"
            )
        object.__setattr__(self, "modes", (DENSE, *(m for m in labels if m != DENSE)))
        if self.graph not in GRAPHS:
            raise ValueError(f"graph {self.graph!r} not in {GRAPHS}")
        check_layout(self.layout)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} must be >= 1")
        check_quant(self.quant)
        if self.reference not in REFERENCE_KINDS:
            raise ValueError(f"reference {self.reference!r} not in {REFERENCE_KINDS}")
        for mode in self.modes:
            validate_namespace(self.namespace_of(mode, warmup=True))

    @property
    def variants(self) -> tuple[ModeVariant, ...]:
        return tuple(ModeVariant.parse(mode) for mode in self.modes)

    def namespace_of(self, mode: str, *, warmup: bool = False) -> str:
        """The store namespace of variant `mode`'s timed samples (or of its warm-up)."""
        variant = ModeVariant.parse(mode).namespace_label
        return f"{self.namespace}-{variant}" + ("-warmup" if warmup else "")


@dataclass(frozen=True)
class SampleRun:
    """One problem's pipeline run in one variant: what its records share."""

    workload: Workload
    problem: Problem
    sample_index: int
    label: str
    num_layers: int


def build_graph(workload: Workload, config: ModeRunConfig) -> AgentGraph:
    roles = with_layout(workload.roles(config.num_agents, config.max_new_tokens), config.layout)
    return fully_connected(roles) if config.graph == "fully_connected" else chain(roles)


def run_modes(
    loaded: LoadedModel,
    workload: Workload,
    problems: Sequence[Problem],
    config: ModeRunConfig,
    store_target: str,
    progress: ProgressFn | None = None,
) -> list[CallRecord]:
    """Every problem through the pipeline in every variant; one record per timed agent call.

    Records carry the variant's label as their mode.
    """
    if not problems:
        raise ValueError("no problems to run")
    graph = build_graph(workload, config)
    variants = config.variants
    counter = _Counter(len(graph) * len(variants) * (len(problems) + int(config.warmup)), progress)
    if config.warmup:
        for variant in variants:
            _warm_up(loaded, workload, graph, problems[0], config, store_target, variant, counter)
    references = _references(loaded, config.reference)
    with ExitStack() as clients:
        engines = {v: _timed_engine(loaded, v, config, store_target, clients) for v in variants}
        records: list[CallRecord] = []
        for index, problem in enumerate(problems):
            for variant in variants:  # interleaved: load drifts alike for every variant
                on_call = counter.callback(f"{variant.label} · {problem.problem_id}")
                trace = run_pipeline(graph, problem.question, engines[variant], ignore_stop=workload.ignore_stop, on_call=on_call)  # fmt: skip
                # Its background puts finish before another variant's calls are timed.
                engines[variant].flush()
                sample = SampleRun(
                    workload, problem, index, variant.label, loaded.layout.num_layers
                )
                records += trace_records(trace, graph, sample, references)
        return records


def trace_records(
    trace: PipelineTrace,
    graph: AgentGraph,
    sample: SampleRun,
    references: DenseReferences | None,
) -> list[CallRecord]:
    """Records of one pipeline run; the final call carries the task score."""
    last = len(trace.calls) - 1
    score = sample.workload.score
    return [
        _record(call, position + 1, graph.steps[position].role.name, sample, references,
                score(sample.problem, call.text) if position == last else None)
        for position, call in enumerate(trace.calls)
    ]  # fmt: skip


def _record(
    call: AgentCall,
    position: int,
    agent_name: str,
    sample: SampleRun,
    references: DenseReferences | None,
    correct: bool | None,
) -> CallRecord:
    fidelity, reference_ttft_s = None, None
    if references is not None:
        if call.mode == DENSE:  # the call is the dense prefill of its own prompt
            references.remember(
                call.prompt.token_ids,
                call.generation,
                call.logits_first,
                call.output_ids,
                call.ttft_s,
            )
        reference = references.get(call.prompt, call.generation)
        fidelity, reference_ttft_s = (
            compare(reference, call.logits_first, call.output_ids),
            reference.ttft_s,
        )
    return CallRecord(
        workload=sample.workload.name, mode=sample.label, sample_index=sample.sample_index,
        problem_id=sample.problem.problem_id, position=position, agent_id=call.agent_id,
        agent_name=agent_name, round=call.round, num_prompt_tokens=call.num_prompt_tokens,
        num_reused_tokens=call.num_reused_tokens, num_output_tokens=len(call.output_ids),
        ttft_s=call.ttft_s, num_layers=sample.num_layers,
        first_token_agrees=None if fidelity is None else fidelity.first_token_agrees,
        kl_dense_reuse=None if fidelity is None else fidelity.kl_dense_reuse,
        max_abs_logit_diff=None if fidelity is None else fidelity.max_abs_logit_diff,
        output_matches=None if fidelity is None else fidelity.output_matches,
        correct=correct, reference_ttft_s=reference_ttft_s, timings_s=call.timings.to_dict(),
        reused_spans=tuple(asdict(s) for s in call.reused), output_text=call.text,
        decisions=dict(call.decisions),
    )  # fmt: skip


def _warm_up(
    loaded: LoadedModel,
    workload: Workload,
    graph: AgentGraph,
    problem: Problem,
    config: ModeRunConfig,
    store_target: str,
    variant: ModeVariant,
    counter: _Counter,
) -> None:
    """One short untimed sample in a throwaway namespace: warms kernels, allocator and channel."""
    namespace = config.namespace_of(variant.label, warmup=True)
    with (
        _connected_client(store_target, namespace, config.store_token) as client,
        _engine(loaded, variant, client, config) as engine,
    ):
        run_pipeline(graph, problem.question, engine, ignore_stop=workload.ignore_stop,
                     max_new_tokens=min(WARMUP_MAX_NEW_TOKENS, config.max_new_tokens), on_call=counter.callback(f"warm-up · {variant.label}"))  # fmt: skip


def _timed_engine(
    loaded: LoadedModel,
    variant: ModeVariant,
    config: ModeRunConfig,
    store_target: str,
    clients: ExitStack,
) -> ReuseEngine:
    """`variant`'s engine for the timed samples, on a connected client of its own namespace."""
    if variant.mode == DENSE:
        return _engine(loaded, variant, None, config)
    client = clients.enter_context(
        _connected_client(store_target, config.namespace_of(variant.label), config.store_token)
    )
    return clients.enter_context(_engine(loaded, variant, client, config))


def _engine(
    loaded: LoadedModel, variant: ModeVariant, client: StoreClient | None, config: ModeRunConfig
) -> ReuseEngine:
    # Dense never touches the store: it is the baseline, and nothing reads its segments.
    store = None if variant.mode == DENSE else client
    # A fresh policy per engine (policies may keep per-store state); no admission check.
    policy = variant.policy(loaded.fingerprint, config.admission)
    return ReuseEngine(
        loaded, policy, store, EngineConfig(quant=config.quant, store_segments=store is not None)
    )


def _references(loaded: LoadedModel, kind: str) -> DenseReferences | None:
    if kind == "off":
        return None
    return DenseReferences(
        ReuseEngine(loaded, DENSE, None, EngineConfig(store_segments=False)), kind
    )


def _connected_client(store_target: str, namespace: str, token: str | None) -> StoreClient:
    """A client whose channel is connected before any timed call (the first RPC pays it)."""
    client = StoreClient(store_target, namespace, token=token)
    client.stats()
    return client


class _Counter:
    def __init__(self, total: int, progress: ProgressFn | None) -> None:
        self.done, self.total, self._progress = 0, total, progress

    def callback(self, label: str) -> Callable[[AgentCall], None]:
        def on_call(call: AgentCall) -> None:
            self.done += 1
            if self._progress is not None:
                self._progress(
                    ProgressEvent(self.done, self.total, f"{label} · agent {call.agent_id}")
                )

        return on_call
