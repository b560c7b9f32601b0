"""`crossfix` end to end on a tiny Llama: answer blocks reused with cross-block attention
restored, margin-guarded, resumed and refused exactly. The gate above it: test_mode_gated_judge."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers.approx import CLOSING, GENERATION, NUM_LAYERS, SYSTEM_3
from helpers.client import make_store_engine, make_tiny_llama
from helpers.judge_prompts import (
    ATOL,
    CONTINUE,
    NEVER_KEPT,
    QUESTION,
    SELECT,
    ChoicePrompt,
    answers,
    candidate_token_layers,
    comparing,
    judge,
    same_as_dense,
)
from helpers.judge_prompts import loaded as loaded  # fixture
from helpers.judge_prompts import store_target as store_target  # fixture
from helpers.modes import one_torch_thread as one_torch_thread  # autouse fixture
from helpers.text import CharTokenizer, FakePrompt, make_prompt

from kvsplice.client.execute.determinism import splits_bitwise
from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.execute.plan import CallPlan, PlanSpan, Source
from kvsplice.client.model.models import LoadedModel, bundle_model
from kvsplice.client.modes import gated
from kvsplice.client.modes.base import CallContext, PlannedCall, SpannedPrompt
from kvsplice.client.modes.crossfix import CrossfixPolicy, Kept
from kvsplice.client.modes.crossfix import Params as CrossfixParams
from kvsplice.client.modes.exact import ExactPolicy
from kvsplice.client.modes.shared import decision_margin, first_token_margin
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.kvmath.segment_kv import SegmentKV


def test_margin_is_top1_minus_top2() -> None:
    assert first_token_margin(torch.tensor([0.5, 3.0, 1.0])) == pytest.approx(2.0)
    assert first_token_margin(torch.tensor([7.0])) == math.inf


def test_decision_margin_is_over_the_declared_choices() -> None:
    logits = torch.tensor([9.0, 3.0, 1.0, 2.5])
    assert decision_margin(logits, ()) == pytest.approx(6.0)
    assert decision_margin(logits, (1, 3)) == pytest.approx(0.5)


def test_crossfix_guards_on_the_choices_a_prompt_declares(
    loaded: LoadedModel, store_target: str
) -> None:
    config = CrossfixParams(ratio=0.0, check_layer=1, min_margin=0.0)
    engine = make_store_engine(loaded, CrossfixPolicy(config), store_target, "xf-choices")
    plain = comparing(answers(engine), SELECT)
    choices = (5, 6, 7)
    outcome = engine.run(ChoicePrompt(plain.token_ids, plain.spans, choices), GENERATION)
    expected = decision_margin(outcome.logits_first, choices)
    assert expected != pytest.approx(first_token_margin(outcome.logits_first))
    assert outcome.decisions["crossfix"].startswith(f"kept: margin {expected:.2f} >= 0 ")


def test_crossfix_without_a_store_equals_dense(loaded: LoadedModel) -> None:
    engine = ReuseEngine(loaded, CrossfixPolicy(), None, EngineConfig(store_segments=False))
    prompt = comparing([tuple(range(40, 50)), tuple(range(60, 66))], SELECT)
    outcome = engine.run(prompt, GENERATION)
    assert outcome.num_reused_tokens == 0
    assert outcome.decisions["crossfix"] == "nothing to reuse"
    reference = engine.dense_reference(prompt, GENERATION)
    assert outcome.generated_ids == reference.generated_ids
    assert torch.equal(outcome.logits_first, reference.logits_first)


@pytest.mark.parametrize(
    ("config", "decision"),
    [
        (CrossfixParams(ratio=1.0, check_layer=1, min_margin=0.0), "kept"),
        (CrossfixParams(ratio=0.5, check_layer=1, min_margin=NEVER_KEPT), "dense"),
    ],
    ids=["ratio-1", "margin-inf"],
)
def test_crossfix_degenerate_settings_equal_dense(
    loaded: LoadedModel, store_target: str, config: CrossfixParams, decision: str
) -> None:
    engine = make_store_engine(
        loaded, CrossfixPolicy(config), store_target, f"xf-degenerate-{decision}"
    )
    prompt, outcome = judge(engine)
    assert outcome.decisions["crossfix"].startswith(decision)
    assert candidate_token_layers(outcome) == 0
    assert same_as_dense(engine, prompt, outcome)


def test_crossfix_reuses_answer_blocks_above_the_check_layer(
    loaded: LoadedModel, store_target: str
) -> None:
    config = CrossfixParams(ratio=0.0, check_layer=1, min_margin=0.0)
    engine = make_store_engine(loaded, CrossfixPolicy(config), store_target, "xf-reuse")
    prompt, outcome = judge(engine)
    assert outcome.decisions["crossfix"].startswith("kept: margin")
    approximate = [s for s in outcome.reused if not s.exact]
    # every answer token reads its stored K/V from layer 1 on (ratio 0; as CacheBlend, the
    # check layer keeps the old K/V of what it drops); the text between them is computed
    assert {s.mode for s in approximate} == {"crossfix"}
    assert {s.num_layers for s in approximate} == {NUM_LAYERS - 1}
    agent_spans = [s for s in prompt.spans if s.name.startswith("agent_")]
    assert sum(s.num_tokens for s in approximate) == sum(s.end - s.start for s in agent_spans)
    assert first_token_margin(outcome.logits_first) >= 0.0


def _question_tokens(prompt: FakePrompt) -> int:
    return sum(s.end - s.start for s in prompt.spans if s.name == "user_question")


def test_crossfix_reuses_the_question_when_asked(loaded: LoadedModel, store_target: str) -> None:
    """q=1: the question, stored by the agents that answered it, is reused as the answers are
    (found by content, every layer below the check computed), and only then."""
    outcomes = {}
    for q in (0, 1):
        config = CrossfixParams(ratio=0.0, check_layer=1, min_margin=0.0, question=q)
        engine = make_store_engine(loaded, CrossfixPolicy(config), store_target, f"xf-q{q}")
        outcomes[q] = judge(engine)
    prompt, plain = outcomes[0]
    _, with_question = outcomes[1]
    answers = sum(s.end - s.start for s in prompt.spans if s.name.startswith("agent_"))
    approximate = [s for s in with_question.reused if not s.exact]
    assert {s.num_layers for s in approximate} == {NUM_LAYERS - 1}
    assert sum(s.num_tokens for s in approximate) == answers + _question_tokens(prompt) > answers
    assert sum(s.num_tokens for s in plain.reused if not s.exact) == answers


def test_crossfix_with_the_question_resumes_and_falls_back_exactly(
    loaded: LoadedModel, store_target: str
) -> None:
    """q=1 under the passes' oracles: a resumed deeper pass equals a fresh pass at its check
    layer, and a call refused by every pass is dense."""
    staged = CrossfixParams(check_layer=1, min_margin=NEVER_KEPT, deep_check=3, question=1)
    engine = make_store_engine(loaded, CrossfixPolicy(staged), store_target, "xf-q-staged")
    _, outcome = judge(engine)
    assert "at check 3 (after margin" in outcome.decisions["crossfix"]
    fresh = CrossfixParams(check_layer=3, min_margin=0.0, question=1)
    _, reference = judge(
        make_store_engine(loaded, CrossfixPolicy(fresh), store_target, "xf-q-fresh3")
    )
    assert float((outcome.logits_first - reference.logits_first).abs().max()) <= ATOL
    assert candidate_token_layers(outcome) == candidate_token_layers(reference) > 0
    refused = replace(staged, deep_margin=NEVER_KEPT)
    engine = make_store_engine(loaded, CrossfixPolicy(refused), store_target, "xf-q-dense")
    prompt, outcome = judge(engine)
    assert outcome.decisions["crossfix"].startswith("dense: margin")
    assert candidate_token_layers(outcome) == 0
    assert same_as_dense(engine, prompt, outcome)


def test_the_gate_prices_the_question_when_its_judge_mode_reuses_it(
    loaded: LoadedModel, store_target: str
) -> None:
    """The judge shape counts the question among the blocks read only for a mode that reads it."""
    engine = make_store_engine(loaded, ExactPolicy(), store_target, "gate-shape-q")
    prompt = comparing(answers(engine), SELECT)
    shapes = {}
    for question in (False, True):
        probe = _ShapeProbe(question)
        namespace = f"gate-shape-q{int(question)}"  # nothing stored: no exact prefix
        make_store_engine(loaded, probe, store_target, namespace).run(prompt, GENERATION)
        shapes[question] = probe.shape
    start = next(s.start for s in prompt.spans if s.name == "user_question")
    assert shapes[True].first_answer == start < shapes[False].first_answer
    added = _question_tokens(prompt)
    assert shapes[True].answer_tokens == shapes[False].answer_tokens + added


class _ShapeProbe(ExactPolicy):
    """An exact policy that records the gate's judge shape of its call."""

    def __init__(self, question: bool) -> None:
        self.question = question
        self.shape: gated.JudgeShape | None = None

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[None]:
        self.shape = gated.judge_shape(prompt, ctx, question=self.question)
        return super().plan(prompt, ctx)


def test_crossfix_guard_keeps_only_confident_prefills(
    loaded: LoadedModel, store_target: str
) -> None:
    """The same call, kept below its margin and prefilled densely above it."""
    probe = CrossfixPolicy(CrossfixParams(ratio=0.0, check_layer=1, min_margin=0.0))
    _, kept = judge(make_store_engine(loaded, probe, store_target, "xf-guard-probe"))
    margin = first_token_margin(kept.logits_first)
    strict = CrossfixPolicy(CrossfixParams(ratio=0.0, check_layer=1, min_margin=margin + 1e-3))
    engine = make_store_engine(loaded, strict, store_target, "xf-guard-strict")
    prompt, outcome = judge(engine)
    assert outcome.decisions["crossfix"].startswith("dense: margin")
    assert same_as_dense(engine, prompt, outcome)


def test_crossfix_deeper_pass_resumed_equals_a_fresh_pass_at_its_check_layer(
    loaded: LoadedModel, store_target: str
) -> None:
    """Oracle of the resume: a first pass at check 1 refused, a second resumed from its
    states at layer 1 and checked at 3, gives what one pass at check 3 gives."""
    staged = CrossfixParams(ratio=0.0, check_layer=1, min_margin=NEVER_KEPT, deep_check=3
    )  # fmt: skip
    engine = make_store_engine(loaded, CrossfixPolicy(staged), store_target, "xf-staged")
    _, outcome = judge(engine)
    decision = outcome.decisions["crossfix"]
    assert decision.startswith("kept: margin") and "at check 3 (after margin" in decision
    fresh = CrossfixParams(ratio=0.0, check_layer=3, min_margin=0.0)
    _, reference = judge(
        make_store_engine(loaded, CrossfixPolicy(fresh), store_target, "xf-fresh3")
    )
    assert float((outcome.logits_first - reference.logits_first).abs().max()) <= ATOL
    assert outcome.generated_ids == reference.generated_ids
    # the answers reused layers 3.. only: their layers below were computed by the passes
    approximate = [s for s in outcome.reused if not s.exact]
    assert {s.num_layers for s in approximate} == {NUM_LAYERS - 3}
    assert candidate_token_layers(outcome) == candidate_token_layers(reference) > 0


def test_crossfix_refused_by_every_pass_is_dense(loaded: LoadedModel, store_target: str) -> None:
    staged = CrossfixParams(ratio=0.0, check_layer=1, min_margin=NEVER_KEPT, deep_check=2,
        deep_margin=NEVER_KEPT,
    )  # fmt: skip
    engine = make_store_engine(loaded, CrossfixPolicy(staged), store_target, "xf-staged-dense")
    prompt, outcome = judge(engine)
    decision = outcome.decisions["crossfix"]
    assert decision.startswith("dense: margin") and "at check 2" in decision
    assert "(after margin" in decision and "at check 1)" in decision
    assert candidate_token_layers(outcome) == 0
    assert same_as_dense(engine, prompt, outcome)


def test_crossfix_deep_check_must_be_deeper() -> None:
    with pytest.raises(ValueError, match="must be above"):
        CrossfixParams(ratio=0.0, check_layer=3, deep_check=2)


def test_a_crossfix_call_over_a_decoded_prefix_is_not_resumed_as_dense() -> None:
    """A decode step's K/V (a stored response) in the kept plan: its dense fallback would not
    be dense prefill's computation bit for bit, so crossfix declines (the gate prefills)."""
    decoded = Source("exact", True, 0, decoded=True)
    kv = SegmentKV(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), start_position=0)
    span = PlanSpan(0, 3, 2, kv, name="prefix@0", source=decoded)
    plan = CallPlan.tiled((1, 2, 3, 4, 5), [span])
    kept = PlannedCall(plan, result=object(), memo=Kept(1, 3))  # type: ignore[arg-type]
    assert CrossfixPolicy().dense_from(kept, None) is None  # type: ignore[arg-type]
    assert CrossfixPolicy().dense_from(replace(kept, memo=None), None) is None  # type: ignore[arg-type]


class _PlanProbe(ExactPolicy):
    """An exact policy that keeps the plan of its last call."""

    plan_seen: CallPlan | None = None

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[None]:
        planned = super().plan(prompt, ctx)
        self.plan_seen = planned.plan
        return planned


def test_an_exact_prefix_marks_the_stored_response_it_reads_as_decoded(
    loaded: LoadedModel, store_target: str
) -> None:
    """The prompt, then its answer, then more: the chain reads the prompt's segments (a
    prefill's K/V) and the answer's (a decode step's), and says which is which."""
    probe = _PlanProbe()
    engine = make_store_engine(loaded, probe, store_target, "xf-decoded-prefix")
    first = make_prompt([("text", "text_0", SYSTEM_3), ("placeholder", "q", QUESTION)])
    answer = engine.run(first, GENERATION).output_ids
    assert answer
    follow = make_prompt(
        [("placeholder", "before", first.token_ids), ("placeholder", "answer", answer),
         ("text", "tail", CONTINUE + CLOSING)]
    )  # fmt: skip
    engine.run(follow, GENERATION)
    assert probe.plan_seen is not None
    sources = [(s.start, s.source) for s in probe.plan_seen.spans if s.source is not None]
    prompt_len = len(first.token_ids)
    in_prompt = [src.decoded for start, src in sources if start < prompt_len]
    in_answer = [src.decoded for start, src in sources if start >= prompt_len]
    assert in_prompt and not any(in_prompt)  # the prompt's prefill
    assert in_answer and all(in_answer)  # the answer's decode


def test_crossfix_dense_fallback_is_dense_prefill_bit_for_bit_where_splits_are(
    store_target: str,
) -> None:
    """The oracle the gate's floor rests on, in bf16: where this machine computes a split
    prompt bit for bit as one prefill, a call refused by every pass (computed on densely
    from its last check layer) gives the dense judge's logits bit for bit."""
    model = make_tiny_llama(seed=0, num_layers=NUM_LAYERS).to(torch.bfloat16)
    loaded = bundle_model(model, CharTokenizer())
    if not splits_bitwise(LayerwiseExecutor(loaded.model)):
        pytest.skip("this machine's kernels round a split prompt otherwise")
    staged = CrossfixParams(
        check_layer=1, min_margin=NEVER_KEPT, deep_check=3, deep_margin=NEVER_KEPT, question=1
    )
    engine = make_store_engine(loaded, CrossfixPolicy(staged), store_target, "xf-bf16-dense")
    prompt, outcome = judge(engine)
    assert outcome.decisions["crossfix"].startswith("dense: margin"), outcome.decisions
    assert outcome.logits_first.dtype == torch.float32  # the head's logits, compared exactly
    reference = engine.dense_reference(prompt, GENERATION)
    assert torch.equal(outcome.logits_first, reference.logits_first)
