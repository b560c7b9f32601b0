"""Judge modes end to end on a tiny Llama: `crossfix` (answer blocks reused with cross-block
attention restored, margin-guarded), `gated` (the judge risk gate above the admitted modes)
and anchor's pooled judge anchors (PAL-KV)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import pytest
import torch
from helpers.approx import CLOSING, GENERATION, NUM_LAYERS, SYSTEM_3, make_loaded4, run_chain
from helpers.client import make_store_engine, make_tiny_llama
from helpers.modes import one_torch_thread as one_torch_thread  # autouse fixture
from helpers.text import CharTokenizer, FakePrompt, make_prompt

from kvsplice.client.execute.determinism import splits_bitwise
from kvsplice.client.execute.execution import ExecutionState
from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.execute.plan import CallPlan, PlanSpan, Source
from kvsplice.client.model.models import LoadedModel, bundle_model
from kvsplice.client.modes import gated
from kvsplice.client.modes.anchor.params import Params as AnchorParams
from kvsplice.client.modes.anchor.policy import AnchorPolicy
from kvsplice.client.modes.base import CallContext, PlannedCall, ReusePolicy, SpannedPrompt
from kvsplice.client.modes.crossfix import CrossfixPolicy, Kept
from kvsplice.client.modes.crossfix import Params as CrossfixParams
from kvsplice.client.modes.dense import DensePolicy
from kvsplice.client.modes.exact import ExactPolicy
from kvsplice.client.modes.gated import GatedPolicy, JudgePricing
from kvsplice.client.modes.naive import NaivePolicy
from kvsplice.client.modes.route_cost import CostModel
from kvsplice.client.modes.shared import decision_margin, first_token_margin
from kvsplice.client.reuse_engine import CallOutcome, EngineConfig, ReuseEngine
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.server.embedded import EmbeddedStore, loopback_config

ATOL = 1e-4
QUESTION = "what is two plus two?"
QUESTIONS = ("what is two plus two?", "name a prime number above ten")
NEAR_DUPLICATE = "what is two plus two!"
SELECT = "\nSelect the agent whose answer is best. Selected agent id: "
CONTINUE = "\nUse their answers and answer again."
# A margin no first token reaches on the tiny model (the knob's upper bound): never kept.
NEVER_KEPT = 1e9


@pytest.fixture(scope="module")
def store_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedStore(loopback_config(str(tmp_path_factory.mktemp("xf") / "lmdb"))) as store:
        yield store.target


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return make_loaded4()


def _answers(engine: ReuseEngine) -> list[tuple[int, ...]]:
    """Two agents answer (their responses land in the store as a pipeline's would)."""
    return [o.output_ids or (32,) for _, o in run_chain(engine, QUESTION)]


def _comparing(answers: list[tuple[int, ...]], instruction: str) -> FakePrompt:
    return _comparing_about(QUESTION, answers, instruction)


def _comparing_about(question: str, answers: list[tuple[int, ...]], instruction: str) -> FakePrompt:
    parts: list[tuple[str, str, str | tuple[int, ...]]] = [
        ("text", "text_0", SYSTEM_3),
        ("placeholder", "user_question", question),
    ]
    for index, answer in enumerate(answers, 1):
        parts += [("text", f"head_{index}", f"\nAgent {index}:\n"),
                  ("placeholder", f"agent_{index}_current", answer)]  # fmt: skip
    parts.append(("text", "tail", instruction + CLOSING))
    return make_prompt(parts)


def _judge(engine: ReuseEngine, instruction: str = SELECT) -> tuple[FakePrompt, CallOutcome]:
    prompt = _comparing(_answers(engine), instruction)
    return prompt, engine.run(prompt, GENERATION)


def _candidate_token_layers(outcome: CallOutcome) -> int:
    return sum(s.num_tokens * s.num_layers for s in outcome.reused if not s.exact)


def _same_as_dense(engine: ReuseEngine, prompt: FakePrompt, outcome: CallOutcome) -> bool:
    reference = engine.dense_reference(prompt, GENERATION)
    return (
        outcome.generated_ids == reference.generated_ids
        and float((outcome.logits_first - reference.logits_first).abs().max()) <= ATOL
    )


def test_margin_is_top1_minus_top2() -> None:
    assert first_token_margin(torch.tensor([0.5, 3.0, 1.0])) == pytest.approx(2.0)
    assert first_token_margin(torch.tensor([7.0])) == math.inf


def test_decision_margin_is_over_the_declared_choices() -> None:
    logits = torch.tensor([9.0, 3.0, 1.0, 2.5])
    assert decision_margin(logits, ()) == pytest.approx(6.0)
    assert decision_margin(logits, (1, 3)) == pytest.approx(0.5)


@dataclass(frozen=True)
class _ChoicePrompt:
    token_ids: tuple[int, ...]
    spans: tuple
    choice_ids: tuple[int, ...]


def test_crossfix_guards_on_the_choices_a_prompt_declares(
    loaded: LoadedModel, store_target: str
) -> None:
    config = CrossfixParams(ratio=0.0, check_layer=1, min_margin=0.0)
    engine = make_store_engine(loaded, CrossfixPolicy(config), store_target, "xf-choices")
    plain = _comparing(_answers(engine), SELECT)
    choices = (5, 6, 7)
    outcome = engine.run(_ChoicePrompt(plain.token_ids, plain.spans, choices), GENERATION)
    expected = decision_margin(outcome.logits_first, choices)
    assert expected != pytest.approx(first_token_margin(outcome.logits_first))
    assert outcome.decisions["crossfix"].startswith(f"kept: margin {expected:.2f} >= 0 ")


def test_crossfix_without_a_store_equals_dense(loaded: LoadedModel) -> None:
    engine = ReuseEngine(loaded, CrossfixPolicy(), None, EngineConfig(store_segments=False))
    prompt = _comparing([tuple(range(40, 50)), tuple(range(60, 66))], SELECT)
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
    prompt, outcome = _judge(engine)
    assert outcome.decisions["crossfix"].startswith(decision)
    assert _candidate_token_layers(outcome) == 0
    assert _same_as_dense(engine, prompt, outcome)


def test_crossfix_reuses_answer_blocks_above_the_check_layer(
    loaded: LoadedModel, store_target: str
) -> None:
    config = CrossfixParams(ratio=0.0, check_layer=1, min_margin=0.0)
    engine = make_store_engine(loaded, CrossfixPolicy(config), store_target, "xf-reuse")
    prompt, outcome = _judge(engine)
    assert outcome.decisions["crossfix"].startswith("kept: margin")
    approximate = [s for s in outcome.reused if not s.exact]
    # every answer token reads its stored K/V from layer 1 on (ratio 0; as CacheBlend, the
    # check layer keeps the old K/V of what it drops); the text between them is computed
    assert {s.mode for s in approximate} == {"crossfix"}
    assert {s.num_layers for s in approximate} == {NUM_LAYERS - 1}
    answers = [s for s in prompt.spans if s.name.startswith("agent_")]
    assert sum(s.num_tokens for s in approximate) == sum(s.end - s.start for s in answers)
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
        outcomes[q] = _judge(engine)
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
    _, outcome = _judge(engine)
    assert "at check 3 (after margin" in outcome.decisions["crossfix"]
    fresh = CrossfixParams(check_layer=3, min_margin=0.0, question=1)
    _, reference = _judge(
        make_store_engine(loaded, CrossfixPolicy(fresh), store_target, "xf-q-fresh3")
    )
    assert float((outcome.logits_first - reference.logits_first).abs().max()) <= ATOL
    assert _candidate_token_layers(outcome) == _candidate_token_layers(reference) > 0
    refused = replace(staged, deep_margin=NEVER_KEPT)
    engine = make_store_engine(loaded, CrossfixPolicy(refused), store_target, "xf-q-dense")
    prompt, outcome = _judge(engine)
    assert outcome.decisions["crossfix"].startswith("dense: margin")
    assert _candidate_token_layers(outcome) == 0
    assert _same_as_dense(engine, prompt, outcome)


def test_the_gate_prices_the_question_when_its_judge_mode_reuses_it(
    loaded: LoadedModel, store_target: str
) -> None:
    """The judge shape counts the question among the blocks read only for a mode that reads it."""
    engine = make_store_engine(loaded, ExactPolicy(), store_target, "gate-shape-q")
    prompt = _comparing(_answers(engine), SELECT)
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
    _, kept = _judge(make_store_engine(loaded, probe, store_target, "xf-guard-probe"))
    margin = first_token_margin(kept.logits_first)
    strict = CrossfixPolicy(CrossfixParams(ratio=0.0, check_layer=1, min_margin=margin + 1e-3))
    engine = make_store_engine(loaded, strict, store_target, "xf-guard-strict")
    prompt, outcome = _judge(engine)
    assert outcome.decisions["crossfix"].startswith("dense: margin")
    assert _same_as_dense(engine, prompt, outcome)


def test_crossfix_deeper_pass_resumed_equals_a_fresh_pass_at_its_check_layer(
    loaded: LoadedModel, store_target: str
) -> None:
    """Oracle of the resume: a first pass at check 1 refused, a second resumed from its
    states at layer 1 and checked at 3, gives what one pass at check 3 gives."""
    staged = CrossfixParams(ratio=0.0, check_layer=1, min_margin=NEVER_KEPT, deep_check=3
    )  # fmt: skip
    engine = make_store_engine(loaded, CrossfixPolicy(staged), store_target, "xf-staged")
    _, outcome = _judge(engine)
    decision = outcome.decisions["crossfix"]
    assert decision.startswith("kept: margin") and "at check 3 (after margin" in decision
    fresh = CrossfixParams(ratio=0.0, check_layer=3, min_margin=0.0)
    _, reference = _judge(
        make_store_engine(loaded, CrossfixPolicy(fresh), store_target, "xf-fresh3")
    )
    assert float((outcome.logits_first - reference.logits_first).abs().max()) <= ATOL
    assert outcome.generated_ids == reference.generated_ids
    # the answers reused layers 3.. only: their layers below were computed by the passes
    approximate = [s for s in outcome.reused if not s.exact]
    assert {s.num_layers for s in approximate} == {NUM_LAYERS - 3}
    assert _candidate_token_layers(outcome) == _candidate_token_layers(reference) > 0


def test_crossfix_refused_by_every_pass_is_dense(loaded: LoadedModel, store_target: str) -> None:
    staged = CrossfixParams(ratio=0.0, check_layer=1, min_margin=NEVER_KEPT, deep_check=2,
        deep_margin=NEVER_KEPT,
    )  # fmt: skip
    engine = make_store_engine(loaded, CrossfixPolicy(staged), store_target, "xf-staged-dense")
    prompt, outcome = _judge(engine)
    decision = outcome.decisions["crossfix"]
    assert decision.startswith("dense: margin") and "at check 2" in decision
    assert "(after margin" in decision and "at check 1)" in decision
    assert _candidate_token_layers(outcome) == 0
    assert _same_as_dense(engine, prompt, outcome)


def test_crossfix_deep_check_must_be_deeper() -> None:
    with pytest.raises(ValueError, match="must be above"):
        CrossfixParams(ratio=0.0, check_layer=3, deep_check=2)


def _gated(
    ordinary: ReusePolicy, judge: ReusePolicy | None, admitted: tuple[str, ...]
) -> GatedPolicy:
    return GatedPolicy(ordinary, ExactPolicy(), judge, judge_admitted=admitted)


def test_gate_sends_a_judge_past_a_mode_not_admitted_for_judges(
    loaded: LoadedModel, store_target: str
) -> None:
    engine = make_store_engine(
        loaded, _gated(NaivePolicy(), None, ()), store_target, "gate-judge-exact"
    )
    prompt, outcome = _judge(engine)
    assert outcome.decisions["gated"] == (
        "judge (answers=2+selection) -> exact: naive not admitted for judges"
    )
    assert not [s for s in outcome.reused if not s.exact]
    assert _same_as_dense(engine, prompt, outcome)


def test_gate_lets_ordinary_calls_run_the_serving_mode(
    loaded: LoadedModel, store_target: str
) -> None:
    engine = make_store_engine(
        loaded, _gated(NaivePolicy(), None, ()), store_target, "gate-ordinary"
    )
    _, outcome = _judge(engine, CONTINUE)
    assert outcome.decisions["gated"] == "ordinary (answers=2+no-selection) -> naive"
    assert {s.mode for s in outcome.reused if not s.exact} == {"naive"}


def test_gate_sends_a_judge_to_the_mode_admitted_for_judges(
    loaded: LoadedModel, store_target: str
) -> None:
    crossfix = CrossfixPolicy(CrossfixParams(ratio=0.0, check_layer=1, min_margin=0.0))
    policy = _gated(NaivePolicy(), crossfix, ("crossfix",))
    engine = make_store_engine(loaded, policy, store_target, "gate-judge-crossfix")
    _, outcome = _judge(engine)
    assert outcome.decisions["gated"] == (
        "judge (answers=2+selection) -> crossfix: admitted for judges"
    )
    assert {s.mode for s in outcome.reused if not s.exact} == {"crossfix"}


def test_a_judge_mode_wins_over_a_zero_drift_serving_mode(loaded: LoadedModel) -> None:
    """The shipped policy's shape: ordinary calls run exact, judges the admitted judge mode."""
    crossfix = CrossfixPolicy(CrossfixParams(ratio=0.0, check_layer=1, min_margin=0.0))
    policy = _gated(ExactPolicy(), crossfix, ("crossfix",))
    engine = ReuseEngine(loaded, policy, None, EngineConfig(store_segments=False))
    outcome = engine.run(_comparing([(40, 41), (50, 51)], SELECT), GENERATION)
    assert outcome.decisions["gated"] == (
        "judge (answers=2+selection) -> crossfix: admitted for judges"
    )


def test_gate_refuses_a_judge_mode_calibration_did_not_admit() -> None:
    with pytest.raises(ValueError, match="not admitted for judges"):
        _gated(NaivePolicy(), CrossfixPolicy(), ())
    with pytest.raises(ValueError, match="fallback"):
        GatedPolicy(NaivePolicy(), NaivePolicy())
    assert _gated(DensePolicy(), None, ()).judge.mode == "exact"


def test_pooled_anchors_serve_a_judge_from_other_agents_and_placeholders(
    loaded: LoadedModel, store_target: str
) -> None:
    """PAL-KV: a judge has no anchors of its own (its template is new); KVComm's per-agent
    pools leave it dense, the pooled retrieval finds the execution agents' anchors."""
    kvcomm = make_store_engine(loaded, AnchorPolicy(), store_target, "pal-kvcomm")
    pooled = make_store_engine(
        loaded, AnchorPolicy(AnchorParams(pool_judges=1)), store_target, "pal-kv"
    )
    decisions = {}
    for name, engine in (("kvcomm", kvcomm), ("pooled", pooled)):
        for question in QUESTIONS:
            run_chain(engine, question)  # fills the question and answer pools (2 agents)
        answers = [o.output_ids or (32,) for _, o in run_chain(engine, NEAR_DUPLICATE)]
        outcome = engine.run(_comparing_about(NEAR_DUPLICATE, answers, SELECT), GENERATION)
        decisions[name] = outcome.decisions
    assert decisions["kvcomm"] == {"anchor_gate": "too_few_eligible"}
    assert decisions["pooled"]["anchor_pool"] == "pooled over 2 answer placeholders (judge)"
    assert decisions["pooled"]["anchor_gate"] != "too_few_eligible"
    # an ordinary call is never pooled
    _, second = run_chain(pooled, QUESTIONS[0])[1]
    assert "anchor_pool" not in second.decisions


class _Remembering:
    """Plans densely with a decision and a memo of its own; remembers what `after_call` got."""

    mode = "naive"

    def __init__(self) -> None:
        self.after: list[PlannedCall[str]] = []

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[str]:
        plan = CallPlan.all_compute(prompt.token_ids)
        return PlannedCall(plan, decisions={"inner": "planned"}, memo="inner memo")

    def after_call(
        self,
        prompt: SpannedPrompt,
        planned: PlannedCall[str],
        state: ExecutionState,
        ctx: CallContext,
        response_ids: Sequence[int],
    ) -> None:
        self.after.append(planned)


def test_the_gate_hands_the_routed_policy_its_own_planned_call(loaded: LoadedModel) -> None:
    inner = _Remembering()
    engine = ReuseEngine(loaded, _gated(inner, None, ()), None, EngineConfig())
    outcome = engine.run(_comparing([(40, 41), (50, 51)], CONTINUE), GENERATION)
    assert list(outcome.decisions.items()) == [
        ("gated", "ordinary (answers=2+no-selection) -> naive"), ("inner", "planned"),
    ]  # fmt: skip
    assert [(p.memo, dict(p.decisions)) for p in inner.after] == [
        ("inner memo", {"inner": "planned"})
    ]


def _priced(cost: CostModel, checks: tuple[int, ...], keep: tuple[float, ...]) -> GatedPolicy:
    params = CrossfixParams(ratio=0.0, check_layer=checks[0], min_margin=0.0)
    crossfix = CrossfixPolicy(params)
    return GatedPolicy(
        NaivePolicy(), ExactPolicy(), crossfix, judge_admitted=("crossfix",),
        pricing=JudgePricing(cost, checks, keep), dense=DensePolicy(),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("cost", "keep", "route", "decision"),
    [
        pytest.param(
            CostModel(1e-3, 0.0, 0.0, 0.0, 0.0), (1.0,), "crossfix",
            "judge (answers=2+selection) -> crossfix: cheapest (predicted ms: exact ",
            id="reading free, computing dear, the pass always kept: crossfix",
        ),
        pytest.param(
            CostModel(1e-6, 0.0, 1.0, 0.0, 0.0), (1.0,), "dense",
            "judge (answers=2+selection) -> dense: cheapest",
            id="each layerwise pass dearer than a dense forward: dense, reusing nothing",
        ),
        pytest.param(
            CostModel(1e-3, 0.0, 0.0, 0.0, 0.0), (), "exact",
            "judge (answers=2+selection) -> exact: cheapest",
            id="keep shares unmeasured (0), crossfix's worst case dearer than exact: exact",
        ),
    ],
)  # fmt: skip
def test_a_priced_gate_sends_a_judge_to_the_cheapest_route_never_one_slower_than_dense(
    loaded: LoadedModel,
    store_target: str,
    cost: CostModel,
    keep: tuple[float, ...],
    route: str,
    decision: str,
) -> None:
    policy = _priced(cost, (1,), keep)
    engine = make_store_engine(loaded, policy, store_target, f"gate-priced-{route}")
    prompt, outcome = _judge(engine)
    assert outcome.decisions["gated"].startswith(decision)
    approximate = {s.mode for s in outcome.reused if not s.exact}
    assert approximate == ({"crossfix"} if route == "crossfix" else set())
    if route == "dense":
        assert not outcome.reused
    if route != "crossfix":
        assert _same_as_dense(engine, prompt, outcome)


def test_a_priced_gate_leaves_ordinary_calls_alone(loaded: LoadedModel, store_target: str) -> None:
    policy = _priced(CostModel(1e-6, 0.0, 1.0, 0.0, 0.0), (1,), (1.0,))
    engine = make_store_engine(loaded, policy, store_target, "gate-priced-ordinary")
    _, outcome = _judge(engine, CONTINUE)
    assert outcome.decisions["gated"] == "ordinary (answers=2+no-selection) -> naive"


def test_a_priced_gate_needs_the_dense_policy() -> None:
    with pytest.raises(ValueError, match="dense policy"):
        GatedPolicy(NaivePolicy(), ExactPolicy(), pricing=JudgePricing(CostModel(1, 0, 0, 0, 0)))


@pytest.mark.parametrize("bitwise", [True, False], ids=["splits-bitwise", "splits-round"])
@pytest.mark.parametrize("floor", [1e-9, NEVER_KEPT])
def test_the_noise_floor_sends_a_close_judge_mode_call_to_the_dense_judge(
    loaded: LoadedModel,
    store_target: str,
    monkeypatch: pytest.MonkeyPatch,
    floor: float,
    bitwise: bool,
) -> None:
    """A judge routed to the admitted mode keeps its passes only when their margin clears the
    dtype's floor; below it the call is dense: the dense judge's own result, nothing reused
    (the tiny model is float32: the floor is set for the test). Where the machine computes a
    split prompt bit for bit as one prefill, the passes are computed on densely from their
    check layer; elsewhere the call is prefilled again from the start."""
    monkeypatch.setitem(gated.NOISE_FLOOR, loaded.model.dtype, floor)
    monkeypatch.setattr(gated, "splits_bitwise", lambda executor: bitwise)
    policy = _priced(CostModel(1e-3, 0.0, 0.0, 0.0, 0.0), (1,), (1.0,))
    namespace = f"gate-floor-{int(floor >= 1)}-{int(bitwise)}"
    engine = make_store_engine(loaded, policy, store_target, namespace)
    plain = _comparing(_answers(engine), SELECT)
    prompt = _ChoicePrompt(plain.token_ids, plain.spans, (5, 6, 7))
    outcome = engine.run(prompt, GENERATION)
    assert " -> crossfix: cheapest " in outcome.decisions["gated"]
    margin = decision_margin(outcome.logits_first, (5, 6, 7))
    if floor < 1:
        assert outcome.decisions[gated.FLOOR_GUARD] == f"kept: margin {margin:.3f} >= {floor:g}"
        assert _candidate_token_layers(outcome) > 0
    else:
        assert outcome.decisions[gated.FLOOR_GUARD].startswith("dense: margin ")
        assert outcome.decisions["crossfix"].startswith("kept: margin ")  # what ran first
        assert _candidate_token_layers(outcome) == 0
        assert _same_as_dense(engine, plain, outcome)
        resumed = outcome.decisions["crossfix"].endswith("; computed on densely from check 1")
        assert resumed == bitwise
        assert outcome.decisions[gated.FLOOR_GUARD].endswith(
            "computed on densely" if bitwise else "prefilled again"
        )


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
    prompt, outcome = _judge(engine)
    assert outcome.decisions["crossfix"].startswith("dense: margin"), outcome.decisions
    assert outcome.logits_first.dtype == torch.float32  # the head's logits, compared exactly
    reference = engine.dense_reference(prompt, GENERATION)
    assert torch.equal(outcome.logits_first, reference.logits_first)
