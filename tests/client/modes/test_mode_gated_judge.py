"""The judge risk gate (`gated`) end to end on a tiny Llama: where it sends a judge, priced routes,
the noise floor, and anchor's pooled judge anchors (PAL-KV)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from helpers import judge_prompts as jp
from helpers.approx import GENERATION, run_chain
from helpers.client import make_store_engine
from helpers.judge_prompts import loaded as loaded  # fixture
from helpers.judge_prompts import store_target as store_target  # fixture
from helpers.modes import one_torch_thread as one_torch_thread  # autouse fixture

from kvsplice.client.execute.execution import ExecutionState
from kvsplice.client.execute.plan import CallPlan
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes import gated
from kvsplice.client.modes.anchor.params import Params as AnchorParams
from kvsplice.client.modes.anchor.policy import AnchorPolicy
from kvsplice.client.modes.base import CallContext, PlannedCall, ReusePolicy, SpannedPrompt
from kvsplice.client.modes.crossfix import CrossfixPolicy
from kvsplice.client.modes.crossfix import Params as CrossfixParams
from kvsplice.client.modes.dense import DensePolicy
from kvsplice.client.modes.exact import ExactPolicy
from kvsplice.client.modes.gated import GatedPolicy, JudgePricing
from kvsplice.client.modes.naive import NaivePolicy
from kvsplice.client.modes.route_cost import CostModel
from kvsplice.client.modes.shared import decision_margin
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine


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
    prompt, outcome = jp.judge(engine)
    assert outcome.decisions["gated"] == (
        "judge (answers=2+selection) -> exact: naive not admitted for judges"
    )
    assert not [s for s in outcome.reused if not s.exact]
    assert jp.same_as_dense(engine, prompt, outcome)


def test_gate_lets_ordinary_calls_run_the_serving_mode(
    loaded: LoadedModel, store_target: str
) -> None:
    engine = make_store_engine(
        loaded, _gated(NaivePolicy(), None, ()), store_target, "gate-ordinary"
    )
    _, outcome = jp.judge(engine, jp.CONTINUE)
    assert outcome.decisions["gated"] == "ordinary (answers=2+no-selection) -> naive"
    assert {s.mode for s in outcome.reused if not s.exact} == {"naive"}


def test_gate_sends_a_judge_to_the_mode_admitted_for_judges(
    loaded: LoadedModel, store_target: str
) -> None:
    crossfix = CrossfixPolicy(CrossfixParams(ratio=0.0, check_layer=1, min_margin=0.0))
    policy = _gated(NaivePolicy(), crossfix, ("crossfix",))
    engine = make_store_engine(loaded, policy, store_target, "gate-judge-crossfix")
    _, outcome = jp.judge(engine)
    assert outcome.decisions["gated"] == (
        "judge (answers=2+selection) -> crossfix: admitted for judges"
    )
    assert {s.mode for s in outcome.reused if not s.exact} == {"crossfix"}


def test_a_judge_mode_wins_over_a_zero_drift_serving_mode(loaded: LoadedModel) -> None:
    """The shipped policy's shape: ordinary calls run exact, judges the admitted judge mode."""
    crossfix = CrossfixPolicy(CrossfixParams(ratio=0.0, check_layer=1, min_margin=0.0))
    policy = _gated(ExactPolicy(), crossfix, ("crossfix",))
    engine = ReuseEngine(loaded, policy, None, EngineConfig(store_segments=False))
    outcome = engine.run(jp.comparing([(40, 41), (50, 51)], jp.SELECT), GENERATION)
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
        for question in jp.QUESTIONS:
            run_chain(engine, question)  # fills the question and answer pools (2 agents)
        answers = [o.output_ids or (32,) for _, o in run_chain(engine, jp.NEAR_DUPLICATE)]
        outcome = engine.run(jp.comparing_about(jp.NEAR_DUPLICATE, answers, jp.SELECT), GENERATION)
        decisions[name] = outcome.decisions
    assert decisions["kvcomm"] == {"anchor_gate": "too_few_eligible"}
    assert decisions["pooled"]["anchor_pool"] == "pooled over 2 answer placeholders (judge)"
    assert decisions["pooled"]["anchor_gate"] != "too_few_eligible"
    # an ordinary call is never pooled
    _, second = run_chain(pooled, jp.QUESTIONS[0])[1]
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
    outcome = engine.run(jp.comparing([(40, 41), (50, 51)], jp.CONTINUE), GENERATION)
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
    prompt, outcome = jp.judge(engine)
    assert outcome.decisions["gated"].startswith(decision)
    approximate = {s.mode for s in outcome.reused if not s.exact}
    assert approximate == ({"crossfix"} if route == "crossfix" else set())
    if route == "dense":
        assert not outcome.reused
    if route != "crossfix":
        assert jp.same_as_dense(engine, prompt, outcome)


def test_a_priced_gate_leaves_ordinary_calls_alone(loaded: LoadedModel, store_target: str) -> None:
    policy = _priced(CostModel(1e-6, 0.0, 1.0, 0.0, 0.0), (1,), (1.0,))
    engine = make_store_engine(loaded, policy, store_target, "gate-priced-ordinary")
    _, outcome = jp.judge(engine, jp.CONTINUE)
    assert outcome.decisions["gated"] == "ordinary (answers=2+no-selection) -> naive"


def test_a_priced_gate_needs_the_dense_policy() -> None:
    with pytest.raises(ValueError, match="dense policy"):
        GatedPolicy(NaivePolicy(), ExactPolicy(), pricing=JudgePricing(CostModel(1, 0, 0, 0, 0)))


@pytest.mark.parametrize("bitwise", [True, False], ids=["splits-bitwise", "splits-round"])
@pytest.mark.parametrize("floor", [1e-9, jp.NEVER_KEPT])
def test_the_noise_floor_sends_a_close_judge_mode_call_to_the_densejudge(
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
    plain = jp.comparing(jp.answers(engine), jp.SELECT)
    prompt = jp.ChoicePrompt(plain.token_ids, plain.spans, (5, 6, 7))
    outcome = engine.run(prompt, GENERATION)
    assert " -> crossfix: cheapest " in outcome.decisions["gated"]
    margin = decision_margin(outcome.logits_first, (5, 6, 7))
    if floor < 1:
        assert outcome.decisions[gated.FLOOR_GUARD] == f"kept: margin {margin:.3f} >= {floor:g}"
        assert jp.candidate_token_layers(outcome) > 0
    else:
        assert outcome.decisions[gated.FLOOR_GUARD].startswith("dense: margin ")
        assert outcome.decisions["crossfix"].startswith("kept: margin ")  # what ran first
        assert jp.candidate_token_layers(outcome) == 0
        assert jp.same_as_dense(engine, plain, outcome)
        resumed = outcome.decisions["crossfix"].endswith("; computed on densely from check 1")
        assert resumed == bitwise
        assert outcome.decisions[gated.FLOOR_GUARD].endswith(
            "computed on densely" if bitwise else "prefilled again"
        )
