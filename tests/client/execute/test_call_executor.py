"""Oracles for the executor's splice path on a tiny random Llama: plans reproduce dense prefill."""

from __future__ import annotations

import pytest
import torch
from helpers.client import VOCAB, make_tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from kvsplice.client.execute.call_executor import CallExecutor, splices_only, takes_splice_path
from kvsplice.client.execute.capture import capture_segments
from kvsplice.client.execute.execution import (
    CallTimings,
    GenerationConfig,
    content_tokens,
    reuse_map,
)
from kvsplice.client.execute.plan import CallPlan, PlanSpan, Source, computed_span, segment_span
from kvsplice.common.layout import KVLayout
from kvsplice.kvmath.rope import RopeSpec


def make_executor(model: LlamaForCausalLM) -> CallExecutor:
    # KVLayout names only storage dtypes; the fp64 oracle model has the same geometry.
    cfg = model.config
    layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size)
    return CallExecutor(model, layout, RopeSpec.from_hf_config(cfg))


def make_prompt(num_tokens: int, seed: int = 1) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (num_tokens,), generator=generator).tolist())


def dense_logits(model: LlamaForCausalLM, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def greedy_without_cache(model: LlamaForCausalLM, ids: tuple[int, ...], num_new: int) -> list[int]:
    """Oracle: recompute the whole sequence for every token (no cache involved)."""
    seq = list(ids)
    for _ in range(num_new):
        seq.append(int(torch.argmax(dense_logits(model, tuple(seq)))))
    return seq[len(ids) :]


def run_plan(
    model: LlamaForCausalLM, plan: CallPlan, num_new: int = 8
) -> tuple[torch.Tensor, list[int]]:
    assert splices_only(plan)
    executor = make_executor(model)
    timings = CallTimings()
    state = executor.prefill(plan, timings)
    executor.generate(state, GenerationConfig(max_new_tokens=num_new), timings)
    return state.logits_first, state.generated


def reuse(
    model: LlamaForCausalLM, ids: tuple[int, ...], start: int, end: int, offset: int = 0
) -> PlanSpan:
    """A span [start, end) reused from a dense capture of ids[:end] run at positions + offset."""
    segment = capture_segments(model, ids[:end], [(start, end)], position_offset=offset).segments[0]
    source = Source("exact", offset == 0, start, -offset)
    return segment_span(segment, start, start_layer=segment.num_layers, source=source)


def test_all_compute_plan_equals_dense_prefill_and_greedy() -> None:
    model, ids = make_tiny_llama(), make_prompt(40)
    logits, tokens = run_plan(model, CallPlan.all_compute(ids))
    assert torch.allclose(logits, dense_logits(model, ids), atol=1e-5, rtol=0)
    assert tokens == greedy_without_cache(model, ids, 8)


def test_exact_prefix_reuse_equals_dense() -> None:
    model, ids = make_tiny_llama(), make_prompt(40)
    plan = CallPlan(ids, (reuse(model, ids, 0, 25), computed_span(25, 40)))
    logits, tokens = run_plan(model, plan)
    assert (logits - dense_logits(model, ids)).abs().max() <= 1e-4
    assert tokens == greedy_without_cache(model, ids, 8)


def test_interleaved_exact_spans_equal_dense() -> None:
    model, ids = make_tiny_llama(), make_prompt(48)
    spans = (
        reuse(model, ids, 0, 10),
        computed_span(10, 17),
        reuse(model, ids, 17, 30),
        computed_span(30, 31),
        reuse(model, ids, 31, 44),
        computed_span(44, 48),
    )
    plan = CallPlan(ids, spans)
    logits, tokens = run_plan(model, plan)
    assert reuse_map(plan, model.config.num_hidden_layers).num_reused_tokens == 10 + 13 + 13
    assert (logits - dense_logits(model, ids)).abs().max() <= 1e-4
    assert tokens == greedy_without_cache(model, ids, 8)


@settings(max_examples=5, deadline=None)
@given(
    offset=st.integers(min_value=1, max_value=3000), split=st.integers(min_value=1, max_value=30)
)
def test_uniform_shift_invariance_fp64(offset: int, split: int) -> None:
    """A prefix captured at positions + offset, moved back by Δ = −offset, equals dense.

    NOTE: HF forms RoPE angles in fp32 even for an fp64 model, so the dense keys
    themselves carry ~|p·θ|·2^-24 angle error; the bound is that, not fp64 epsilon.
    """
    model, ids = make_tiny_llama(torch.float64), make_prompt(32)
    plan = CallPlan(ids, (reuse(model, ids, 0, split, offset), computed_span(split, 32)))
    logits, _ = run_plan(model, plan, num_new=1)
    assert plan.spans[0].delta == -offset
    assert (logits - dense_logits(model, ids)).abs().max() <= 1e-6


def test_uniform_shift_invariance_fp32_within_rope_tolerance() -> None:
    model, ids = make_tiny_llama(), make_prompt(32)
    plan = CallPlan(ids, (reuse(model, ids, 0, 28, offset=3000), computed_span(28, 32)))
    logits, tokens = run_plan(model, plan)
    assert (logits - dense_logits(model, ids)).abs().max() <= 1e-5
    assert tokens == greedy_without_cache(model, ids, 8)


def test_read_kv_of_generated_tokens_matches_dense_capture() -> None:
    model, ids = make_tiny_llama(), make_prompt(20)
    executor, timings = make_executor(model), CallTimings()
    state = executor.prefill(CallPlan.all_compute(ids), timings)
    executor.generate(state, GenerationConfig(max_new_tokens=6), timings)
    response = executor.read_kv(state, 20, 26)  # the last token was never fed: read_kv feeds it
    full = ids + tuple(state.generated)
    oracle = capture_segments(model, full, [(20, 26)]).segments[0]
    assert response.start_position == 20
    assert torch.allclose(response.keys, oracle.keys, atol=1e-4)
    assert torch.allclose(response.values, oracle.values, atol=1e-4)


def test_generation_stops_at_stop_token_and_content_drops_it() -> None:
    model, ids = make_tiny_llama(), make_prompt(20)
    free_run = greedy_without_cache(model, ids, 6)
    stop = free_run[2]
    config = GenerationConfig(max_new_tokens=6, stop_token_ids=(stop,))
    executor, timings = make_executor(model), CallTimings()
    state = executor.prefill(CallPlan.all_compute(ids), timings)
    executor.generate(state, config, timings)
    first_stop = free_run.index(stop)
    assert state.generated == free_run[: first_stop + 1]
    assert content_tokens(state.generated, config) == tuple(free_run[:first_stop])
    ignoring = GenerationConfig(max_new_tokens=6, stop_token_ids=(stop,), ignore_stop=True)
    assert content_tokens(free_run, ignoring) == tuple(free_run)


def test_the_last_token_is_computed_and_plans_reject_gaps() -> None:
    model, ids = make_tiny_llama(), make_prompt(12)
    tiled = CallPlan.tiled(ids, [reuse(model, ids, 4, 12)])
    assert [(s.start, s.end, s.computed) for s in tiled.spans] == [
        (0, 4, True), (4, 11, False), (11, 12, True),
    ]  # fmt: skip
    assert tiled.spans[1].source is not None  # the cut span keeps its source
    reused_last = CallPlan(ids, (computed_span(0, 4), reuse(model, ids, 4, 12)))
    assert not splices_only(reused_last)
    with pytest.raises(ValueError, match="computes no layer"):
        make_executor(model).prefill(reused_last, CallTimings())
    with pytest.raises(ValueError, match="starts at"):
        CallPlan(ids, (computed_span(0, 4), computed_span(5, 12)))
    segment = reuse(model, ids, 0, 4)
    with pytest.raises(ValueError, match="hold"):
        PlanSpan(0, 5, 2, segment.kv)


def test_timings_record_prefill_and_splice() -> None:
    model, ids = make_tiny_llama(), make_prompt(24)
    plan = CallPlan(ids, (reuse(model, ids, 0, 12, offset=5), computed_span(12, 24)))
    timings = CallTimings()
    make_executor(model).prefill(plan, timings)
    assert timings.prefill_s > 0 and timings.splice_s > 0  # the shift is part of the splice


def test_teacher_forced_answer_has_the_kv_its_generation_had() -> None:
    """Forcing the tokens greedy decoding produced gives their K/V (up to summation order)."""
    model = make_tiny_llama()
    executor = make_executor(model)
    prompt = make_prompt(12)
    plan = CallPlan.all_compute(prompt)
    generated = executor.prefill(plan, CallTimings())
    executor.generate(generated, GenerationConfig(6, ignore_stop=True), CallTimings())
    forced = executor.prefill(plan, CallTimings())
    config = GenerationConfig(6, forced_ids=tuple(generated.generated), ignore_stop=True)
    executor.generate(forced, config, CallTimings())
    assert forced.generated == generated.generated
    reference = executor.read_kv(generated, 12, 18)
    taught = executor.read_kv(forced, 12, 18)
    torch.testing.assert_close(taught.keys, reference.keys, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(taught.values, reference.values, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="forced tokens"):
        GenerationConfig(2, forced_ids=(1, 2, 3))


def test_splice_path_equals_the_layerwise_loop_on_the_same_plan() -> None:
    """The two paths of one executor agree on a plan both can run (exact and Δ-shifted reuse)."""
    model, ids = make_tiny_llama(), make_prompt(40)
    plan = CallPlan.tiled(ids, [reuse(model, ids, 0, 12), reuse(model, ids, 20, 33, offset=7)])
    assert splices_only(plan)
    executor = make_executor(model)
    spliced = executor.splice_prefill(plan, CallTimings())
    looped = executor.layerwise.run(plan)
    assert (spliced.logits_first - looped.logits_last).abs().max() <= 1e-5
    assert spliced.reuse == reuse_map(plan, model.config.num_hidden_layers, looped.kept_slots)
    assert [(r.start, r.end, r.layers) for r in spliced.reuse.reused] == [
        (0, 12, (0, 2)), (20, 33, (0, 2)),
    ]  # fmt: skip


def test_a_run_handed_to_prefill_is_continued_not_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, ids = make_tiny_llama(), make_prompt(20)
    plan = CallPlan.tiled(ids, [reuse(model, ids, 0, 12)])
    executor = make_executor(model)
    ran = executor.layerwise.run(plan)
    monkeypatch.setattr(executor.layerwise, "run", lambda _: pytest.fail("ran again"))
    state = executor.prefill(plan, CallTimings(), ran)
    assert state.layerwise is ran and torch.equal(state.logits_first, ran.logits_last)
    assert state.generated == [int(torch.argmax(ran.logits_last))]


def test_computed_tokens_in_several_places_take_the_layer_loop() -> None:
    """One computed run (the tail) is spliced and run once; computed runs between reused
    spans go through the decoder-layer loop in one pass per layer, with the same logits."""
    model, ids = make_tiny_llama(), make_prompt(40)
    tail_only = CallPlan.tiled(ids, [reuse(model, ids, 0, 30)])
    several = CallPlan.tiled(ids, [reuse(model, ids, 0, 12), reuse(model, ids, 20, 33, offset=7)])
    assert takes_splice_path(tail_only) and splices_only(several)
    assert not takes_splice_path(several)
    executor = make_executor(model)
    assert executor.prefill(tail_only, CallTimings()).layerwise is None
    looped = executor.prefill(several, CallTimings())
    assert looped.layerwise is not None
    spliced = executor.splice_prefill(several, CallTimings())
    assert (spliced.logits_first - looped.logits_first).abs().max() <= 1e-5
    assert spliced.generated == looped.generated
