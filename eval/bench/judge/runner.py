"""Running judge examples in several modes against the dense judge of the same prompt.

Owns the judge protocol: candidates generated once, densely (or given), so every mode
judges the identical set; per mode, one store namespace where each candidate is first
teacher-forced through its execution agent's prompt by that mode's engine (the store
then holds what a pipeline in that mode would: its answers' K/V, bases, anchors), then
the judge call; the dense judge of the byte-identical prompt as the reference, outside
every mode's TTFT; modes interleaved per example. Figures are `jcr`'s.
"""

from __future__ import annotations

import logging
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

from kvsplice.agents.graph import AnswerRef, QuestionRef
from kvsplice.agents.judge import (
    REGIMES,
    DisplayOrder,
    JudgePipeline,
    check_judge_layout,
    check_num_candidates,
    judge_pipeline,
)
from kvsplice.agents.pipeline import Sampling, run_pipeline, stop_token_ids
from kvsplice.agents.render import RenderedPrompt, render, tokenize_text
from kvsplice.client.execute.execution import ExecutionState, GenerationConfig
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.admission import AdmissionPolicy, load_policy
from kvsplice.client.modes.base import candidate_blocks
from kvsplice.client.modes.registry import MODES
from kvsplice.client.reuse_engine import CallOutcome, EngineConfig, ReuseEngine
from kvsplice.common.reuse_modes import GATED
from kvsplice.common.segment import validate_namespace
from kvsplice.eval.bench.mode_runner import ProgressEvent, ProgressFn
from kvsplice.eval.bench.mode_variants import ModeVariant
from kvsplice.eval.measure.jcr import JudgeRecord, candidate_token_layers
from kvsplice.eval.measure.judge_selection import Selection, choice_token_ids, read_selection
from kvsplice.eval.workloads.judge_examples import JudgeExample, is_correct
from kvsplice.storeclient.client import StoreClient

logger = logging.getLogger(__name__)

DENSE = "dense"
# The admission policy with the risk gate above it, as a worker runs it (issue 14's gate).
NO_ANSWER = "(no answer)"


@dataclass(frozen=True)
class JudgeRunConfig:
    """How to judge. `modes`: variant specs (`mode_variants`) or "gated"; dense runs first.

    `max_new_tokens`: each execution agent's cap when candidates are generated;
    `temperature`: > 0 samples them (best-of-N: each draw seeded by `seed`, the example
    and the agent, so reruns judge the same sets), 0 decodes greedily;
    `judge_max_new_tokens`: the judge's free text (parsed for coverage). `shuffle`: a
    per-example permutation drawn from `seed` (else agent order). `layout`: the judge
    pipeline's (`agents.judge.JUDGE_LAYOUTS`; in a transcript the agents speak in display
    order). `admission`: base parameters of every variant, and the policy "gated" runs
    (None: the defaults).
    """

    modes: tuple[str, ...] = (DENSE, "naive")
    regime: str = "progressive"
    num_candidates: int = 4
    shuffle: bool = True
    seed: int = 0
    layout: str = "persona-first"
    max_new_tokens: int = 64
    temperature: float = 0.0
    judge_max_new_tokens: int = 6
    warmup: bool = True
    namespace: str = "kvsplice-judge"
    store_token: str | None = None
    admission: AdmissionPolicy | None = None

    def __post_init__(self) -> None:
        labels = [m if m == GATED else ModeVariant.parse(m).label for m in self.modes]
        if GATED in labels and GATED not in MODES:
            raise ValueError(f"mode {GATED!r} needs the risk gate, which this build lacks")
        if len(set(labels)) != len(labels):
            raise ValueError(f"modes {tuple(labels)} repeat")
        object.__setattr__(self, "modes", (DENSE, *(m for m in labels if m != DENSE)))
        if self.regime not in REGIMES:
            raise ValueError(f"regime {self.regime!r} not in {REGIMES}")
        check_num_candidates(self.num_candidates)
        check_judge_layout(self.layout)
        if self.max_new_tokens < 1 or self.judge_max_new_tokens < 1:
            raise ValueError("max_new_tokens and judge_max_new_tokens must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature {self.temperature} must be finite and >= 0")
        for mode in self.modes:
            validate_namespace(self.namespace_of(mode, warmup=True))

    def namespace_of(self, mode: str, *, warmup: bool = False) -> str:
        label = mode if mode == GATED else ModeVariant.parse(mode).namespace_label
        return f"{self.namespace}-{label}" + ("-warmup" if warmup else "")


@dataclass(frozen=True)
class Candidates:
    """An example's candidate answers: agent id → token ids, and their texts and checks."""

    ids: Mapping[str, tuple[int, ...]]
    texts: Mapping[str, str]
    correct: Mapping[str, bool | None]

    @property
    def agent_ids(self) -> tuple[str, ...]:
        return tuple(self.ids)


@dataclass(frozen=True)
class JudgeCall:
    """One judge call's outcome and its selection."""

    outcome: CallOutcome
    selection: Selection


# Sees (mode, example, prompt, prefilled state) of every judge call, dense reference
# included (mode "reference"), before decoding (the attention diagnostics).
PrefillProbe = Callable[[str, JudgeExample, RenderedPrompt, ExecutionState], None]


@dataclass
class JudgeRun:
    """Every record, and each example's candidates and display order."""

    records: list[JudgeRecord] = field(default_factory=list)
    candidates: dict[str, Candidates] = field(default_factory=dict)
    orders: dict[str, DisplayOrder] = field(default_factory=dict)


def run_judges(
    loaded: LoadedModel,
    examples: Sequence[JudgeExample],
    config: JudgeRunConfig,
    store_target: str,
    progress: ProgressFn | None = None,
    probe: PrefillProbe | None = None,
) -> JudgeRun:
    """Judge every example in every mode; one record per (example, mode)."""
    if not examples:
        raise ValueError("no examples to judge")
    reference = ReuseEngine(loaded, DENSE, None, EngineConfig(store_segments=False))
    tick = _Ticker(len(examples) * (len(config.modes) + 1) + int(config.warmup), progress)
    run = JudgeRun()
    if config.warmup:
        _warm_up(loaded, examples[0], config, store_target, reference)
        tick("warm-up")
    with ExitStack() as stack:
        engines = {m: _engine(loaded, m, config, store_target, stack) for m in config.modes}
        for example in examples:
            order = display_order(example, config)
            pipeline = _pipeline(example, order, config)
            candidates = make_candidates(reference, example, pipeline, config)
            tick(f"candidates · {example.example_id}")
            run.candidates[example.example_id] = candidates
            run.orders[example.example_id] = order
            run.records += _judge_example(
                loaded, example, candidates, pipeline, order, engines, reference, config, tick,
                probe,
            )  # fmt: skip
    return run


def display_order(example: JudgeExample, config: JudgeRunConfig) -> DisplayOrder:
    """The example's display order of candidate agents "1".."n" (n: the given candidates,
    else `num_candidates`), drawn before any is generated: a transcript speaks in it."""
    count = config.num_candidates if example.candidates is None else len(example.candidates)
    ids = [str(i) for i in range(1, count + 1)]
    if config.shuffle:
        return DisplayOrder.shuffled(ids, config.seed, example.example_id)
    return DisplayOrder.fixed(ids)


def _pipeline(example: JudgeExample, order: DisplayOrder, config: JudgeRunConfig) -> JudgePipeline:
    return judge_pipeline(example.task, order, config.regime, config.max_new_tokens, config.layout)


def make_candidates(
    dense: ReuseEngine, example: JudgeExample, pipeline: JudgePipeline, config: JudgeRunConfig
) -> Candidates:
    """The given candidates tokenized, or the execution agents' answers, generated densely
    (keyed by candidate agent id, "1".."n"), sampled when `config.temperature` > 0."""
    tokenizer = dense.loaded.tokenizer
    if example.candidates is not None:
        texts = {str(i): t for i, t in enumerate(example.candidates, 1)}
        ids = {a: tokenize_text(tokenizer, t) for a, t in texts.items()}
    else:
        graph = pipeline.graph
        sampling = None
        if config.temperature > 0:
            seed = zlib.crc32(f"{config.seed}:{example.example_id}".encode())
            sampling = Sampling(config.temperature, seed)
        trace = run_pipeline(
            graph, example.question, dense, max_new_tokens=config.max_new_tokens,
            sampling=sampling,
        )  # fmt: skip
        spoken = {
            pipeline.agent_of(c.agent_id): c.output_ids or tokenize_text(tokenizer, NO_ANSWER)
            for c in trace.calls
        }
        ids = {a: spoken[a] for a in sorted(spoken, key=int)}
        texts = {a: dense.loaded.decode(i, skip_special_tokens=True) for a, i in ids.items()}
    correct = {a: is_correct(example, t) for a, t in texts.items()}
    return Candidates(ids, texts, correct)


def judge_prompt(
    loaded: LoadedModel,
    example: JudgeExample,
    candidates: Candidates,
    pipeline: JudgePipeline,
    order: DisplayOrder,
) -> RenderedPrompt:
    """The judge's prompt for `order`: byte-identical for the dense judge and every mode;
    it declares the labels' tokens, the constrained choice its selection is read from."""
    values: dict[str, str | tuple[int, ...]] = {"user_question": example.question}
    values.update(
        {f"agent_{pipeline.speakers[a]}_current": ids for a, ids in candidates.ids.items()}
    )
    prompt = render(pipeline.template, values, loaded.tokenizer)
    return replace(prompt, choice_ids=choice_token_ids(loaded.tokenizer, order.labels))


def teacher_force(
    engine: ReuseEngine, example: JudgeExample, candidates: Candidates, pipeline: JudgePipeline
) -> None:
    """Each candidate through its execution agent's prompt, as if that agent generated it."""
    tokenizer = engine.loaded.tokenizer
    for step in pipeline.graph:
        values = {
            name: example.question
            if isinstance(ref, QuestionRef)
            else candidates.ids[pipeline.agent_of(ref.agent_id)]
            for name, ref in step.fills.items()
            if isinstance(ref, QuestionRef | AnswerRef)
        }
        prompt = render(step.role.template, values, tokenizer)
        forced = candidates.ids[pipeline.agent_of(step.agent_id)]
        engine.run(prompt, GenerationConfig(len(forced), forced_ids=forced, ignore_stop=True))
    engine.flush()


def _judge_example(
    loaded: LoadedModel,
    example: JudgeExample,
    candidates: Candidates,
    pipeline: JudgePipeline,
    order: DisplayOrder,
    engines: Mapping[str, ReuseEngine],
    reference: ReuseEngine,
    config: JudgeRunConfig,
    tick: Callable[[str], None],
    probe: PrefillProbe | None,
) -> list[JudgeRecord]:
    prompt = judge_prompt(loaded, example, candidates, pipeline, order)
    choice_ids = prompt.choice_ids
    dense = _judge(reference, "reference", example, prompt, order, choice_ids, config, probe)
    records = []
    for mode, engine in engines.items():
        if engine.store is not None:
            teacher_force(engine, example, candidates, pipeline)
        call = _judge(engine, mode, example, prompt, order, choice_ids, config, probe)
        records.append(_record(mode, example, candidates, order, prompt, call, dense, loaded))
        tick(f"{mode} · {example.example_id}")
    return records


def _judge(
    engine: ReuseEngine,
    mode: str,
    example: JudgeExample,
    prompt: RenderedPrompt,
    order: DisplayOrder,
    choice_ids: Sequence[int],
    config: JudgeRunConfig,
    probe: PrefillProbe | None,
) -> JudgeCall:
    tokenizer = engine.loaded.tokenizer
    generation = GenerationConfig(
        config.judge_max_new_tokens, stop_token_ids=stop_token_ids(tokenizer, "<|im_end|>")
    )
    on_prefill = None if probe is None else (lambda s: probe(mode, example, prompt, s))
    outcome = engine.run(prompt, generation, on_prefill=on_prefill)
    engine.flush()
    text = engine.loaded.decode(outcome.output_ids, skip_special_tokens=True)
    return JudgeCall(outcome, read_selection(outcome.logits_first, text, order, choice_ids))


def _record(
    mode: str,
    example: JudgeExample,
    candidates: Candidates,
    order: DisplayOrder,
    prompt: RenderedPrompt,
    call: JudgeCall,
    dense: JudgeCall,
    loaded: LoadedModel,
) -> JudgeRecord:
    blocks = candidate_blocks(prompt)
    chosen, reference = call.selection, dense.selection
    return JudgeRecord(
        example_id=example.example_id, task=example.task, mode=mode, order=order.agent_ids,
        agent_id=chosen.agent_id, slot=chosen.slot, margin=chosen.margin,
        parsed_agent_id=chosen.parsed_agent_id, dense_agent_id=reference.agent_id,
        dense_slot=reference.slot, dense_margin=reference.margin,
        dense_parsed_agent_id=reference.parsed_agent_id, ttft_s=call.outcome.ttft_s,
        dense_ttft_s=dense.outcome.ttft_s, num_prompt_tokens=prompt.num_tokens,
        num_reused_tokens=call.outcome.num_reused_tokens,
        num_candidate_tokens=sum(b.num_tokens for b in blocks),
        num_candidate_token_layers_reused=candidate_token_layers(blocks, call.outcome.reused),
        num_layers=loaded.layout.num_layers, correct=candidates.correct[chosen.agent_id],
        dense_correct=candidates.correct[reference.agent_id], text=chosen.text,
        dense_text=reference.text, decisions=dict(call.outcome.decisions),
        scores=chosen.scores, dense_scores=reference.scores,
    )  # fmt: skip


def _engine(
    loaded: LoadedModel, mode: str, config: JudgeRunConfig, target: str, stack: ExitStack,
    *, warmup: bool = False,
) -> ReuseEngine:  # fmt: skip
    """`mode`'s engine on a client of its own namespace (dense: no store at all)."""
    if mode == DENSE:
        return ReuseEngine(loaded, DENSE, None, EngineConfig(store_segments=False))
    client = StoreClient(target, config.namespace_of(mode, warmup=warmup), token=config.store_token)
    stack.enter_context(client)
    client.stats()  # connect before any timed call
    engine_config = EngineConfig(quant="none")
    if mode == GATED:  # the worker's way: a named mode under its admission policy
        # the policy given, else the one shipped for the model (else the safe default)
        admission = config.admission or load_policy(None, loaded.fingerprint)
        engine = ReuseEngine(loaded, GATED, client, engine_config, admission=admission)
    else:
        policy = ModeVariant.parse(mode).policy(loaded.fingerprint, config.admission)
        engine = ReuseEngine(loaded, policy, client, engine_config)
    return stack.enter_context(engine)


def _warm_up(
    loaded: LoadedModel,
    example: JudgeExample,
    config: JudgeRunConfig,
    target: str,
    reference: ReuseEngine,
) -> None:
    """One untimed, short judge of `example` per mode in throwaway namespaces."""
    short = replace(config, max_new_tokens=8)
    order = display_order(example, short)
    pipeline = _pipeline(example, order, short)
    candidates = make_candidates(reference, example, pipeline, short)
    prompt = judge_prompt(loaded, example, candidates, pipeline, order)
    with ExitStack() as stack:
        for mode in config.modes:
            engine = _engine(loaded, mode, config, target, stack, warmup=True)
            if engine.store is not None:
                teacher_force(engine, example, candidates, pipeline)
            _judge(engine, mode, example, prompt, order, prompt.choice_ids, short, None)


class _Ticker:
    def __init__(self, total: int, progress: ProgressFn | None) -> None:
        self.done, self.total, self._progress = 0, total, progress

    def __call__(self, message: str) -> None:
        self.done += 1
        if self._progress is not None:
            self._progress(ProgressEvent(self.done, self.total, message))
