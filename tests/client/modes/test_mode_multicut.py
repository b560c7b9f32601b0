"""Oracles for multicut reuse: the W_exact guard, the cut choice, and plans on a tiny Llama."""

from __future__ import annotations

import pytest
import torch
from helpers.modes import (
    ATOL,
    CHUNK,
    END,
    IDS,
    NUM_LAYERS,
    START,
    capture,
    dense_logits,
    full_reuse_span,
    make_ids,
    make_llama,
    make_rope,
    plan_with,
)
from helpers.modes import one_torch_thread as one_torch_thread  # autouse fixture
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.modes.multicut import (
    FULL,
    ExactWindow,
    choose_cut,
    common_suffix_len,
    multicut_plan,
    multicut_span,
)
from kvsplice.kvmath.segment_kv import SegmentKV

W = ExactWindow(((0, 0), (2, 4), (4, FULL)))
ALL_CUTS = tuple(range(NUM_LAYERS + 1))


def test_w_exact_steps_up_to_the_next_point_and_is_full_past_the_last() -> None:
    table = ExactWindow(((0, 128), (8, 512), (16, FULL)))
    assert [table(layer) for layer in (0, 1, 8, 9, 16)] == [128, 512, 512, FULL, FULL]
    assert ExactWindow(((0, 2),))(1) == FULL
    assert table.required(4, left_context_len=100) == 100  # a short context needs all of it
    assert table.required(0, left_context_len=1000) == 128


@pytest.mark.parametrize(
    "points",
    [
        (),
        ((0, 8), (4, 2)),
        ((0, FULL), (4, 8)),
        ((0, 1), (0, 2)),
        ((-1, 0),),
        ((0, -3),),
        ((0, "all"),),
    ],
)
def test_w_exact_rejects_decreasing_or_malformed_tables(points: tuple) -> None:
    with pytest.raises(ValueError):
        ExactWindow(points)


windows = st.one_of(st.integers(0, 1000), st.just(FULL))


@settings(max_examples=50, deadline=None)
@given(points=st.dictionaries(st.integers(0, 40), windows, min_size=1, max_size=6))
def test_any_accepted_table_is_monotone(points: dict) -> None:
    rank = {FULL: float("inf")}
    try:
        table = ExactWindow(tuple(points.items()))
    except ValueError:
        ordered = [points[layer] for layer in sorted(points)]
        values = [rank.get(w, w) for w in ordered]
        assert values != sorted(values)  # rejected only when the table decreases
        return
    values = [rank.get(table(layer), table(layer)) for layer in range(45)]
    assert values == sorted(values)


@pytest.mark.parametrize(
    ("exact_window", "left_len", "expected"),
    [(0, 8, 0), (3, 8, 0), (4, 8, 2), (7, 8, 2), (8, 8, 4), (2, 2, 4), (0, 0, 4)],
)
def test_choose_cut_takes_the_deepest_cut_whose_window_holds(
    exact_window: int, left_len: int, expected: int
) -> None:
    assert choose_cut((0, 2, 4), exact_window, left_len, W) == expected


def test_choose_cut_is_none_when_no_stored_cut_passes() -> None:
    assert choose_cut((2, 4), 3, 8, W) is None
    assert choose_cut((), 8, 8, W) is None
    with pytest.raises(ValueError):
        choose_cut((0,), 9, 8, W)


def test_common_suffix_len_counts_trailing_matches() -> None:
    assert common_suffix_len((1, 2, 3, 4), (9, 3, 4)) == 2
    assert common_suffix_len((1, 2), (1, 2)) == 2
    assert common_suffix_len((5,), (6,)) == 0


def run_cut(model: LlamaForCausalLM, segment: SegmentKV, cut: int) -> torch.Tensor:
    plan = multicut_plan(IDS, [(START, segment, cut)], num_layers=NUM_LAYERS)
    return LayerwiseExecutor(model).run(plan).logits_last


@pytest.mark.parametrize("cut", ALL_CUTS)
def test_exact_boundary_states_make_any_cut_dense(cut: int) -> None:
    """Captured from the same prompt at positions shifted by 7: reuse + recompute from h_cut = dense."""
    model = make_llama()
    segment = capture(model, IDS, START, END, boundary_layers=ALL_CUTS, position_offset=7)
    torch.testing.assert_close(
        run_cut(model, segment, cut), dense_logits(model, IDS), atol=ATOL, rtol=0
    )


def foreign_segment(model: LlamaForCausalLM) -> SegmentKV:
    """The chunk captured after another left context (approximate reuse), with every boundary state."""
    other = make_ids(5, 22)
    ids = (*other, *CHUNK)
    return capture(model, ids, len(other), len(ids), boundary_layers=ALL_CUTS)


def test_cut_zero_is_dense_and_cut_l_is_naive_reuse() -> None:
    model = make_llama()
    segment = foreign_segment(model)
    dense = dense_logits(model, IDS)
    torch.testing.assert_close(run_cut(model, segment, 0), dense, atol=ATOL, rtol=0)
    naive = plan_with(IDS, full_reuse_span(segment, START, make_rope(model)))
    naive_logits = LayerwiseExecutor(model).run(naive).logits_last
    assert torch.equal(run_cut(model, segment, NUM_LAYERS), naive_logits)
    # measured max |Δlogit| vs dense: cut 1 0.083, cut 2 0.149, cut 3 0.196, cut 4 (naive) 0.196
    assert (naive_logits - dense).abs().max() > 1000 * ATOL
    assert (run_cut(model, segment, NUM_LAYERS // 2) - dense).abs().max() > 100 * ATOL


def test_multicut_span_reads_only_the_layers_below_the_cut() -> None:
    model = make_llama()
    segment = foreign_segment(model)
    span = multicut_span(segment, START, 2, num_layers=NUM_LAYERS)
    assert (span.start, span.end, span.start_layer, span.num_kv_layers) == (START, END, 2, 2)
    assert torch.equal(span.hidden, segment.boundary_states[2])
    del segment.boundary_states[3]
    with pytest.raises(ValueError, match="boundary state"):
        multicut_span(segment, START, 3, num_layers=NUM_LAYERS)
