"""Oracles for reuse plans: exact prefix K/V, multicut from exact boundary states, full reuse."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from helpers.layerwise import NUM_LAYERS, dense_forward, dense_kv, make_model, make_prompt
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedModel

from kvsplice.client.execute.capture import capture_segments
from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.execute.plan import CallPlan, PlanSpan, segment_span
from kvsplice.kvmath.segment_kv import SegmentKV

ATOL = 1e-4  # measured max |Δlogit| <= 2.4e-7 (Δ-shifted reuse), <= 2.1e-7 otherwise
ARCHS = ("llama", "qwen2", "gemma3")
CUTS = (0, NUM_LAYERS // 2, NUM_LAYERS)


def reused_span(
    model: PreTrainedModel, ids: tuple[int, ...], start: int, end: int, cut: int
) -> PlanSpan:
    """Tokens [start, end) with dense K/V and the dense boundary state at `cut` (multicut)."""
    segment = capture_segments(model, ids, [(start, end)], boundary_layers=[cut]).segments[0]
    return segment_span(segment, start, start_layer=cut, name="reused")


def tile(num_tokens: int, *spans: PlanSpan) -> tuple[PlanSpan, ...]:
    """`spans` in order with computed spans filling the gaps."""
    out: list[PlanSpan] = []
    cursor = 0
    for span in spans:
        if span.start > cursor:
            out.append(PlanSpan(cursor, span.start, name="computed"))
        out.append(span)
        cursor = span.end
    if cursor < num_tokens:
        out.append(PlanSpan(cursor, num_tokens, name="computed"))
    return tuple(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_exact_prefix_reuse_equals_dense(arch: str) -> None:
    model = make_model(arch)
    ids = make_prompt(18)
    dense_logits, cache = dense_forward(model, ids)
    keys, values = dense_kv(cache, 0, 10)
    spans = tile(len(ids), PlanSpan(0, 10, NUM_LAYERS, SegmentKV(keys, values, 0), name="prefix"))
    result = LayerwiseExecutor(model).run(CallPlan(ids, spans))
    torch.testing.assert_close(result.logits_last, dense_logits[-1], atol=ATOL, rtol=0)
    assert result.num_computed == (8,) * NUM_LAYERS
    torch.testing.assert_close(
        result.kv.read(0, len(ids))[0], dense_kv(cache, 0, len(ids))[0], atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(("start", "end"), [(0, 9), (4, 13)])
def test_multicut_from_exact_boundary_equals_dense(
    arch: str, cut: int, start: int, end: int
) -> None:
    """Reuse layers < cut, recompute layers >= cut from h_cut: dense, for a prefix or a middle span."""
    model = make_model(arch)
    ids = make_prompt(17)
    dense_logits, _ = dense_forward(model, ids)
    spans = tile(len(ids), reused_span(model, ids, start, end, cut))
    result = LayerwiseExecutor(model).run(CallPlan(ids, spans))
    torch.testing.assert_close(result.logits_last, dense_logits[-1], atol=ATOL, rtol=0)
    span_tokens = end - start
    assert result.num_computed == tuple(
        len(ids) - (span_tokens if layer < cut else 0) for layer in range(NUM_LAYERS)
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_captured_boundary_states_equal_capture_module(arch: str) -> None:
    """States the executor captures are the residual stream `capture_segments` records."""
    model = make_model(arch)
    ids = make_prompt(12)
    layers = (0, 2, NUM_LAYERS)
    segment = capture_segments(model, ids, [(3, 9)], boundary_layers=layers).segments[0]
    plan = CallPlan.all_compute(ids, capture_layers=layers)
    captured = LayerwiseExecutor(model).run(plan).hidden_states
    for layer in layers:
        torch.testing.assert_close(
            captured[layer].span(3, 9), segment.boundary_states[layer], atol=ATOL, rtol=0
        )


def test_captured_states_cover_only_computed_tokens() -> None:
    model = make_model("llama")
    ids = make_prompt(12)
    span = reused_span(model, ids, 0, 6, cut=2)
    plan = CallPlan(ids, tile(len(ids), span), capture_layers=(1, 3))
    captured = LayerwiseExecutor(model).run(plan).hidden_states
    assert captured[1].slots == tuple(range(6, 12))
    assert captured[3].slots == tuple(range(12))
    with pytest.raises(ValueError, match="not computed"):
        captured[1].span(0, 6)


@pytest.mark.parametrize("arch", ARCHS)
def test_shifted_segment_reuse_matches_dense_within_rope_tolerance(arch: str) -> None:
    """A prefix captured at positions 50.. and Δ-shifted to 0.. reproduces dense prefill.

    The prefix's K/V do not depend on what follows, so only fp32 RoPE rounding differs.
    """
    model = make_model(arch)
    ids = make_prompt(14)
    dense_logits, _ = dense_forward(model, ids)
    segment = capture_segments(model, ids[:8], [(0, 8)], position_offset=50).segments[0]
    span = segment_span(segment, 0, start_layer=NUM_LAYERS)
    result = LayerwiseExecutor(model).run(CallPlan(ids, tile(len(ids), span)))
    torch.testing.assert_close(result.logits_last, dense_logits[-1], atol=ATOL, rtol=0)


def test_plan_position_offset_moves_reused_keys() -> None:
    """With position_offset, the executor shifts keys to offset + slot (dense at shifted positions)."""
    model = make_model("llama")
    ids = make_prompt(10)
    dense_logits, _ = dense_forward(model, ids, position_offset=20)
    segment = capture_segments(model, ids[:6], [(0, 6)]).segments[0]
    span = segment_span(segment, 0, start_layer=NUM_LAYERS, position_offset=20)
    result = LayerwiseExecutor(model).run(CallPlan(ids, tile(len(ids), span), position_offset=20))
    torch.testing.assert_close(result.logits_last, dense_logits[-1], atol=ATOL, rtol=0)


@functools.cache
def gemma3_oracle() -> tuple[PreTrainedModel, tuple[int, ...], torch.Tensor, object]:
    """Gemma3 (sliding + full layers), a 16-token prompt, its dense logits and full capture."""
    model = make_model("gemma3")
    ids = make_prompt(16, seed=3)
    dense_logits, _ = dense_forward(model, ids)
    layers = range(NUM_LAYERS + 1)
    segment = capture_segments(model, ids, [(0, len(ids))], boundary_layers=layers).segments[0]
    return model, ids, dense_logits[-1], segment


@settings(max_examples=12, deadline=None)
@given(
    cuts=st.lists(st.integers(1, 15), max_size=4, unique=True).map(sorted),
    layers=st.lists(st.integers(0, NUM_LAYERS), min_size=5, max_size=5),
)
def test_any_tiling_with_exact_kv_and_boundaries_equals_dense(
    cuts: list[int], layers: list[int]
) -> None:
    """Spans cut anywhere, each starting at any layer from its exact state: always dense."""
    model, ids, dense_last, segment = gemma3_oracle()
    bounds = [0, *cuts, len(ids)]
    spans = []
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        start_layer = min(layers[i], NUM_LAYERS - 1) if end == len(ids) else layers[i]
        hidden = segment.boundary_states[start_layer][start:end]
        keys, values = segment.keys[:, :, start:end], segment.values[:, :, start:end]
        spans.append(PlanSpan(start, end, start_layer, SegmentKV(keys, values, start), hidden))
    result = LayerwiseExecutor(model).run(CallPlan(ids, tuple(spans)))
    torch.testing.assert_close(result.logits_last, dense_last, atol=ATOL, rtol=0)
