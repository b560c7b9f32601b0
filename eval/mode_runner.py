"""Running one workload's problems through the agent pipeline in several reuse modes.

Owns the measurement protocol shared by `bench agents` and the demo: one fresh
store namespace per mode (modes never feed each other), one untimed warm-up
sample per mode in its own throwaway namespace, modes interleaved per sample
(dense first) so machine load drifts alike for all, samples in sequence within
a mode (later ones may reuse earlier ones' segments), a dense reference per
reuse call outside its TTFT. Aggregation and reporting are elsewhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass

from kvsplice.agents.graph import AgentGraph, chain, fully_connected
from kvsplice.agents.pipeline import AgentCall, PipelineTrace, run_pipeline
from kvsplice.client.models import LoadedModel
from kvsplice.client.policies import MODES
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.client.store_client import StoreClient
from kvsplice.common.segment import validate_namespace
from kvsplice.eval.fidelity import REFERENCE_KINDS, DenseReferences, compare
from kvsplice.eval.metrics import DENSE, CallRecord
from kvsplice.eval.workload_types import Problem, Workload
from kvsplice.kvmath.quant import QUANT_SCHEMES

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
    """How to run the modes. `modes` must include "dense" (the speedup baseline); it runs first.

    `quant` is the stored payload scheme ("none" keeps exact mode bit-faithful).
    `reference`: "full" (dense first-token logits and greedy output per reuse
    call), "first_token" (logits only), or "off".
    """

    modes: tuple[str, ...] = (DENSE, "exact", "naive")
    num_agents: int = 3
    graph: str = "fully_connected"
    max_new_tokens: int = 64
    quant: str = "none"
    reference: str = "full"
    warmup: bool = True
    namespace: str = "kvsplice-eval"
    store_token: str | None = None

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or DENSE not in self.modes or len(set(self.modes)) != len(self.modes):
            raise ValueError(
                f"modes {self.modes} must be distinct, from {MODES}, and include {DENSE!r}"
            )
        object.__setattr__(self, "modes", (DENSE, *(m for m in self.modes if m != DENSE)))
        if self.graph not in GRAPHS:
            raise ValueError(f"graph {self.graph!r} not in {GRAPHS}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} must be >= 1")
        if self.quant not in QUANT_SCHEMES:
            raise ValueError(f"quant {self.quant!r} not in {QUANT_SCHEMES}")
        if self.reference not in REFERENCE_KINDS:
            raise ValueError(f"reference {self.reference!r} not in {REFERENCE_KINDS}")
        validate_namespace(self.namespace_of(DENSE, warmup=True))

    def namespace_of(self, mode: str, *, warmup: bool = False) -> str:
        """The store namespace of `mode`'s timed samples (or of its warm-up)."""
        return f"{self.namespace}-{mode}" + ("-warmup" if warmup else "")


def build_graph(workload: Workload, config: ModeRunConfig) -> AgentGraph:
    roles = workload.roles(config.num_agents, config.max_new_tokens)
    return fully_connected(roles) if config.graph == "fully_connected" else chain(roles)


def run_modes(
    loaded: LoadedModel,
    workload: Workload,
    problems: Sequence[Problem],
    config: ModeRunConfig,
    store_target: str,
    progress: ProgressFn | None = None,
) -> list[CallRecord]:
    """Every problem through the pipeline in every mode; one record per timed agent call."""
    if not problems:
        raise ValueError("no problems to run")
    graph = build_graph(workload, config)
    counter = _Counter(
        len(graph) * len(config.modes) * (len(problems) + int(config.warmup)), progress
    )
    if config.warmup:
        for mode in config.modes:
            _warm_up(loaded, workload, graph, problems[0], config, store_target, mode, counter)
    references = _references(loaded, config.reference)
    with ExitStack() as clients:
        engines = {m: _timed_engine(loaded, m, config, store_target, clients) for m in config.modes}
        records: list[CallRecord] = []
        for index, problem in enumerate(problems):
            for mode in config.modes:  # interleaved: load drifts alike for every mode
                on_call = counter.callback(f"{mode} · {problem.problem_id}")
                trace = run_pipeline(graph, problem.question, engines[mode], ignore_stop=workload.ignore_stop, on_call=on_call)  # fmt: skip
                records += trace_records(trace, graph, workload, problem, index, references)
        return records


def trace_records(
    trace: PipelineTrace,
    graph: AgentGraph,
    workload: Workload,
    problem: Problem,
    sample_index: int,
    references: DenseReferences | None,
) -> list[CallRecord]:
    """Records of one pipeline run; the final call carries the task score."""
    last = len(trace.calls) - 1
    return [
        _record(call, position + 1, graph.steps[position].role.name, workload, problem, sample_index, references,
                workload.score(problem, call.output_text) if position == last else None)
        for position, call in enumerate(trace.calls)
    ]  # fmt: skip


def _record(
    call: AgentCall,
    position: int,
    agent_name: str,
    workload: Workload,
    problem: Problem,
    sample_index: int,
    references: DenseReferences | None,
    correct: bool | None,
) -> CallRecord:
    fidelity, reference_ttft_s = None, None
    if references is not None:
        if call.mode == DENSE:  # the call is the dense prefill of its own prompt
            references.remember(
                call.prompt.token_ids,
                call.generation,
                call.first_token_logits,
                call.output_ids,
                call.ttft_s,
            )
        reference = references.get(call.prompt, call.generation)
        fidelity, reference_ttft_s = (
            compare(reference, call.first_token_logits, call.output_ids),
            reference.ttft_s,
        )
    return CallRecord(
        workload=workload.name, mode=call.mode, sample_index=sample_index, problem_id=problem.problem_id,
        position=position, agent_id=call.agent_id, agent_name=agent_name, round=call.round,
        num_prompt_tokens=call.num_prompt_tokens, num_reused_tokens=call.num_reused_tokens,
        num_output_tokens=len(call.output_ids), ttft_s=call.ttft_s,
        first_token_agrees=None if fidelity is None else fidelity.first_token_agrees,
        kl_dense_reuse=None if fidelity is None else fidelity.kl_dense_reuse,
        max_abs_logit_diff=None if fidelity is None else fidelity.max_abs_logit_diff,
        output_matches=None if fidelity is None else fidelity.output_matches,
        correct=correct, reference_ttft_s=reference_ttft_s, timings_s=call.timings.to_dict(),
        reused_spans=tuple(asdict(s) for s in call.reused_spans), output_text=call.output_text,
    )  # fmt: skip


def _warm_up(
    loaded: LoadedModel,
    workload: Workload,
    graph: AgentGraph,
    problem: Problem,
    config: ModeRunConfig,
    store_target: str,
    mode: str,
    counter: _Counter,
) -> None:
    """One short untimed sample in a throwaway namespace: warms kernels, allocator and channel."""
    with _connected_client(
        store_target, config.namespace_of(mode, warmup=True), config.store_token
    ) as client:
        engine = _engine(loaded, mode, client, config.quant)
        run_pipeline(graph, problem.question, engine, ignore_stop=workload.ignore_stop,
                     max_new_tokens=min(WARMUP_MAX_NEW_TOKENS, config.max_new_tokens), on_call=counter.callback(f"warm-up · {mode}"))  # fmt: skip


def _timed_engine(
    loaded: LoadedModel, mode: str, config: ModeRunConfig, store_target: str, clients: ExitStack
) -> ReuseEngine:
    """`mode`'s engine for the timed samples, on a connected client of its own namespace."""
    if mode == DENSE:
        return _engine(loaded, mode, None, config.quant)
    client = clients.enter_context(
        _connected_client(store_target, config.namespace_of(mode), config.store_token)
    )
    return _engine(loaded, mode, client, config.quant)


def _engine(loaded: LoadedModel, mode: str, client: StoreClient | None, quant: str) -> ReuseEngine:
    # Dense never touches the store: it is the baseline, and nothing reads its segments.
    store = None if mode == DENSE else client
    return ReuseEngine(
        loaded, mode, store, EngineConfig(quant=quant, store_segments=store is not None)
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
