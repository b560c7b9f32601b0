"""Plan validation: malformed layerwise plans are refused with a ValueError naming the problem."""

from __future__ import annotations

import pytest
import torch
from helpers.layerwise import NUM_LAYERS, make_model, make_prompt

from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.execute.plan import CallPlan, PlanSpan, SubsetRule
from kvsplice.kvmath.segment_kv import SegmentKV

HEADS, HEAD_DIM, HIDDEN = 2, 16, 64


def make_kv(num_layers: int, num_tokens: int, heads: int = HEADS) -> SegmentKV:
    keys = torch.randn(num_layers, heads, num_tokens, HEAD_DIM)
    return SegmentKV(keys, torch.randn_like(keys), 0)


def test_spans_must_tile_the_prompt() -> None:
    ids = make_prompt(6)
    with pytest.raises(ValueError, match="starts at 3, expected 2"):
        CallPlan(ids, (PlanSpan(0, 2), PlanSpan(3, 6)))
    with pytest.raises(ValueError, match="cover 4 of 6"):
        CallPlan(ids, (PlanSpan(0, 4),))


def test_span_needs_kv_for_the_layers_it_skips() -> None:
    with pytest.raises(ValueError, match="provides K/V for 1 layers"):
        PlanSpan(0, 3, 2, make_kv(1, 3))
    with pytest.raises(ValueError, match="hold 4 tokens"):
        PlanSpan(0, 3, 1, make_kv(2, 4))
    with pytest.raises(ValueError, match="hidden"):
        PlanSpan(0, 3, 1, make_kv(2, 3), hidden=torch.zeros(2, HIDDEN))


def test_logits_slots_default_to_the_last_token_and_are_sorted() -> None:
    ids = make_prompt(6)
    assert CallPlan.all_compute(ids).logits_slots == (5,)
    assert CallPlan.all_compute(ids, logits_slots=(4, 1, 4)).logits_slots == (1, 4)


@pytest.mark.parametrize(
    ("spans", "match"),
    [
        (
            (PlanSpan(0, 3, 2, make_kv(NUM_LAYERS, 3)), PlanSpan(3, 6)),
            "without a hidden state",
        ),
        (
            (PlanSpan(0, 3), PlanSpan(3, 6, NUM_LAYERS, make_kv(NUM_LAYERS, 3))),
            "computes no layer",
        ),
        (
            (
                PlanSpan(0, 3, 1, make_kv(NUM_LAYERS + 1, 3), hidden=torch.zeros(3, HIDDEN)),
                PlanSpan(3, 6),
            ),
            "exceed",
        ),
        ((PlanSpan(0, 3, 0, make_kv(NUM_LAYERS, 3, heads=3)), PlanSpan(3, 6)), "heads"),
    ],
)
def test_executor_refuses_plans_that_do_not_fit_the_model(spans: tuple, match: str) -> None:
    plan = CallPlan(make_prompt(6), spans)
    with pytest.raises(ValueError, match=match):
        LayerwiseExecutor(make_model("llama")).run(plan)


def test_check_layer_must_exist() -> None:
    rule = SubsetRule(NUM_LAYERS, lambda *a: torch.arange(0))
    plan = CallPlan(make_prompt(4), (PlanSpan(0, 4),), subsets=(rule,))
    with pytest.raises(ValueError, match="check_layer"):
        LayerwiseExecutor(make_model("llama")).run(plan)


def test_one_subset_rule_per_check_layer() -> None:
    rule = SubsetRule(1, lambda *a: torch.arange(0))
    with pytest.raises(ValueError, match="one subset rule per check layer"):
        CallPlan(make_prompt(4), (PlanSpan(0, 4),), subsets=(rule, rule))
