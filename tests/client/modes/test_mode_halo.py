"""Oracles for halo recompute and the boundary KL acceptance test on a tiny Llama."""

from __future__ import annotations

import math

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
    foreign_chunk,
    full_reuse_span,
    make_ids,
    make_llama,
    make_rope,
    plan_with,
)
from helpers.modes import one_torch_thread as one_torch_thread  # autouse fixture
from transformers import LlamaForCausalLM

from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.execute.plan import CallPlan, PlanSpan
from kvsplice.client.modes.halo import (
    AcceptanceResult,
    Params,
    check_acceptance,
    halo_plan,
    halo_split,
    kl_nats,
    probed_plan,
    reference_plan,
)
from kvsplice.kvmath.segment_kv import SegmentKV


def make_span(start: int = 3, end: int = 9) -> PlanSpan:
    keys = torch.randn(2, 1, end - start, 4, generator=torch.Generator().manual_seed(start))
    return PlanSpan(start, end, 2, SegmentKV(keys, keys + 1.0, start), name="reused")


def naive_plan(model: LlamaForCausalLM, segment: SegmentKV) -> CallPlan:
    return plan_with(IDS, full_reuse_span(segment, START, make_rope(model)))


def test_halo_split_computes_the_first_h_tokens_and_keeps_the_rest() -> None:
    span = make_span()
    assert halo_split(span, 0) == (span,)
    halo, rest = halo_split(span, 2)
    assert (halo.start, halo.end, halo.start_layer, halo.kv) == (3, 5, 0, None)
    assert (rest.start, rest.end, rest.start_layer) == (5, 9, 2)
    assert isinstance(rest.kv, SegmentKV) and isinstance(span.kv, SegmentKV)
    assert torch.equal(rest.kv.keys, span.kv.keys[:, :, 2:])
    assert torch.equal(rest.kv.values, span.kv.values[:, :, 2:])
    (whole,) = halo_split(span, 10)
    assert (whole.start, whole.end, whole.kv) == (3, 9, None)
    with pytest.raises(ValueError):
        halo_split(span, -1)


def test_halo_plan_skips_spans_at_slot_zero_and_exact_ones() -> None:
    first, exact, approx = make_span(0, 3), make_span(3, 6), make_span(8, 12)
    exact = PlanSpan(3, 6, 2, exact.kv, name="exact")
    plan = plan_with(make_ids(14, 1), first, exact, approx)
    spans = halo_plan(plan, 1, exact_names={"exact"}).spans
    assert [(s.start, s.end, s.start_layer) for s in spans] == [
        (0, 3, 2), (3, 6, 2), (6, 8, 0), (8, 9, 0), (9, 12, 2), (12, 14, 0),
    ]  # fmt: skip


def test_halo_over_the_whole_span_is_dense_and_no_halo_is_naive() -> None:
    model = make_llama()
    naive = naive_plan(model, foreign_chunk(model))
    executor = LayerwiseExecutor(model)
    dense = dense_logits(model, IDS)
    whole = executor.run(halo_plan(naive, len(CHUNK))).logits_last
    torch.testing.assert_close(whole, dense, atol=ATOL, rtol=0)
    assert torch.equal(
        executor.run(halo_plan(naive, 0)).logits_last, executor.run(naive).logits_last
    )
    # measured max |Δlogit| vs dense: h = 0 0.196, h = 1 0.176, h = 2 0.155, h = 4 0.115
    assert (executor.run(halo_plan(naive, 2)).logits_last - dense).abs().max() > 100 * ATOL


def test_kl_nats_matches_a_hand_computed_divergence() -> None:
    """KL((½, ½) ‖ (¾, ¼)) = ½·ln(4/3) nats."""
    reference, reuse = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]])
    assert kl_nats(reference, reuse)[0] == pytest.approx(0.5 * math.log(4 / 3))
    assert kl_nats(reuse, reuse) == (0.0,)


def test_probes_are_the_last_tokens_of_each_approximate_span() -> None:
    model = make_llama()
    plan = naive_plan(model, foreign_chunk(model))
    probed, probes = probed_plan(plan, 3)
    assert probes == (END - 3, END - 2, END - 1)
    assert probed.logits_slots == (*probes, len(IDS) - 1)
    assert [(s.start, s.end, s.start_layer) for s in probed.spans] == [
        (0, START, 0), (START, END - 3, NUM_LAYERS), (END - 3, END, 0), (END, len(IDS), 0),
    ]  # fmt: skip
    reference = reference_plan(probed, probes)
    assert reference.token_ids == IDS[:END]
    assert all(span.start_layer == 0 for span in reference.spans)


def run_acceptance(model: LlamaForCausalLM, segment: SegmentKV) -> AcceptanceResult:
    return check_acceptance(
        LayerwiseExecutor(model), naive_plan(model, segment), num_probe=4, epsilon_nats=0.05
    )


def test_acceptance_accepts_an_exact_segment_and_rejects_random_kv() -> None:
    """A peaked model (init 0.1): the same prompt's own K/V give KL 0; random K/V give KL ~0.2-0.5."""
    model = make_llama(initializer_range=0.1)
    exact = capture(model, IDS, START, END)
    accepted = run_acceptance(model, exact)
    assert accepted.accepted and max(accepted.kl_nats) < 1e-9
    assert (
        accepted.reference_token_layers == END * NUM_LAYERS
    )  # the cost: every token up to the span end
    generator = torch.Generator().manual_seed(5)
    noise = [
        torch.randn(exact.keys.shape, generator=generator) * t.std()
        for t in (exact.keys, exact.values)
    ]
    rejected = run_acceptance(model, SegmentKV(noise[0], noise[1], START))
    assert not rejected.accepted and min(rejected.kl_nats) > 0.05


def test_acceptance_with_nothing_approximate_runs_no_reference() -> None:
    model = make_llama()
    result = check_acceptance(LayerwiseExecutor(model), CallPlan.all_compute(IDS))
    assert (result.accepted, result.probe_slots, result.reference_token_layers) == (True, (), 0)


@pytest.mark.parametrize("bad", [{"num_probe": 0}, {"epsilon_nats": -1.0}])
def test_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        Params(**bad)
