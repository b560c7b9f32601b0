"""Oracles for CacheBlend-style blending (notes §6 test 10): r = 1 dense, r = 0 naive, top-k selection."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.modes import (
    ATOL,
    END,
    IDS,
    START,
    capture,
    dense_logits,
    foreign_chunk,
    full_reuse_span,
    make_llama,
    make_rope,
    plan_with,
)
from helpers.modes import one_torch_thread as one_torch_thread  # autouse fixture
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor, LayerwiseResult
from kvsplice.client.modes.blend import Params
from kvsplice.client.modes.shared import (
    DeviationSelector,
    blend_plan,
    blend_rule,
    num_selected,
    token_deviation,
)


def run_blend(model: LlamaForCausalLM, params: Params) -> LayerwiseResult:
    rule = blend_rule(params.check_layer, params.ratio, params.deviation)
    plan = blend_plan(IDS, [(START, foreign_chunk(model))], rule)
    return LayerwiseExecutor(model).run(plan)


@settings(max_examples=50, deadline=None)
@given(num_candidates=st.integers(0, 500), ratio=st.floats(0.0, 1.0))
def test_num_selected_is_floor_of_m_r_within_bounds(num_candidates: int, ratio: float) -> None:
    count = num_selected(num_candidates, ratio)
    assert 0 <= count <= num_candidates
    assert count in (math.floor(num_candidates * ratio), math.floor(num_candidates * ratio + 1e-9))
    assert (
        num_selected(num_candidates, 1.0) == num_candidates
        and num_selected(num_candidates, 0.0) == 0
    )


def make_pair(scores_sqrt: list[float], heads: int = 2, dim: int = 3) -> torch.Tensor:
    """[H, M, D] whose token m differs from zero by scores_sqrt[m] / √(H·D) per element."""
    scale = torch.tensor(scores_sqrt) / math.sqrt(heads * dim)
    return scale.view(1, -1, 1).expand(heads, -1, dim).clone()


def test_selector_keeps_the_top_k_deviations_in_ascending_order() -> None:
    """Value deviations 4, 0, 9, 1, 16 and key deviations reversed: r = 0.4 keeps 2 of 5."""
    values, keys = make_pair([2.0, 0.0, 3.0, 1.0, 4.0]), make_pair([4.0, 1.0, 3.0, 0.0, 2.0])
    zeros = torch.zeros_like(values)
    new_kv, old_kv = (keys, values), (zeros, zeros)
    torch.testing.assert_close(
        token_deviation(new_kv, old_kv, "value"), torch.tensor([4.0, 0.0, 9.0, 1.0, 16.0])
    )
    assert DeviationSelector(0.4)(1, new_kv, old_kv).tolist() == [2, 4]
    assert DeviationSelector(0.4, "key")(1, new_kv, old_kv).tolist() == [0, 2]
    assert DeviationSelector(0.0)(1, new_kv, old_kv).tolist() == []


def test_ratio_one_is_dense() -> None:
    model = make_llama()
    result = run_blend(model, Params(ratio=1.0))
    torch.testing.assert_close(result.logits_last, dense_logits(model, IDS), atol=ATOL, rtol=0)
    assert result.kept_slots[1] == tuple(range(len(IDS)))


def test_ratio_zero_is_naive_reuse() -> None:
    """Layer 0 recomputed (context-free, so it equals the reused layer 0), the rest the old K/V."""
    model = make_llama()
    naive = plan_with(IDS, full_reuse_span(foreign_chunk(model), START, make_rope(model)))
    naive_logits = LayerwiseExecutor(model).run(naive).logits_last
    torch.testing.assert_close(
        run_blend(model, Params(ratio=0.0)).logits_last, naive_logits, atol=ATOL, rtol=0
    )
    # measured max |Δlogit| vs dense: naive 0.196, r = 0.15 0.176, r = 0.5 0.086
    assert (naive_logits - dense_logits(model, IDS)).abs().max() > 1000 * ATOL


@pytest.mark.parametrize("deviation", ["value", "key"])
def test_selected_set_is_the_top_k_deviation_at_the_check_layer_plus_the_rest(
    deviation: str,
) -> None:
    """At check layer 1 after a full layer 0, new K/V are dense K/V: rank (dense − old)² by hand."""
    model = make_llama()
    rope = make_rope(model)
    old = foreign_chunk(model)
    dense = capture(model, IDS, START, END)
    old_keys = rope.shift_layers(old.keys, START - old.start_position)
    tensors = (dense.keys, old_keys) if deviation == "key" else (dense.values, old.values)
    scores = (tensors[0][1] - tensors[1][1]).square().sum(dim=(0, 2))
    top = sorted((START + int(i) for i in torch.topk(scores, 3).indices), key=int)
    result = run_blend(model, Params(ratio=0.25, deviation=deviation))
    assert result.kept_slots[1] == (*range(START), *top, *range(END, len(IDS)))
    assert (result.logits_last - dense_logits(model, IDS)).abs().max() > 100 * ATOL


@pytest.mark.parametrize(
    "bad", [{"ratio": 1.5}, {"ratio": -0.1}, {"check_layer": -1}, {"deviation": "hidden"}]
)
def test_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        Params(**bad)
