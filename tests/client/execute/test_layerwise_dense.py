"""Oracle: an all-compute layerwise plan is the model's own forward (Llama, Qwen2, Gemma3)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.layerwise import GEMMA_WINDOW, dense_forward, dense_kv, make_model, make_prompt
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import masking_utils

from kvsplice.client.execute.active import additive_mask, allowed_keys
from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.execute.plan import CallPlan
from kvsplice.client.model.hf_cache import cache_kwarg
from kvsplice.client.model.model_adapter import DecoderAdapter

ATOL = 1e-4  # measured: 0.0 (bit-identical) on every tiny model below
ARCHS = ("llama", "qwen2", "gemma3")
ATTNS = ("sdpa", "eager")


@pytest.mark.parametrize("attn", ATTNS)
@pytest.mark.parametrize("arch", ARCHS)
def test_all_compute_equals_model_forward(arch: str, attn: str) -> None:
    model = make_model(arch, attn)
    ids = make_prompt(3 * GEMMA_WINDOW + 5)  # longer than Gemma3's window
    dense_logits, cache = dense_forward(model, ids)
    plan = CallPlan.all_compute(ids, logits_slots=tuple(range(len(ids))))
    result = LayerwiseExecutor(model).run(plan)
    keys, values = dense_kv(cache, 0, len(ids))
    torch.testing.assert_close(result.logits, dense_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(result.kv.keys, keys, atol=ATOL, rtol=0)
    torch.testing.assert_close(result.kv.values, values, atol=ATOL, rtol=0)
    assert result.num_computed == (len(ids),) * model.config.num_hidden_layers


@pytest.mark.parametrize("arch", ARCHS)
def test_position_offset_equals_forward_at_shifted_positions(arch: str) -> None:
    model = make_model(arch)
    ids = make_prompt(11)
    dense_logits, _ = dense_forward(model, ids, position_offset=37)
    result = LayerwiseExecutor(model).run(CallPlan.all_compute(ids, position_offset=37))
    torch.testing.assert_close(result.logits_last, dense_logits[-1], atol=ATOL, rtol=0)
    assert result.kv.to_segment(2, 5).start_position == 39


def test_gemma3_sliding_window_is_respected() -> None:
    """Ignoring the window (all layers full attention) must change the logits."""
    model = make_model("gemma3", "eager")
    ids = make_prompt(4 * GEMMA_WINDOW)
    dense_logits, _ = dense_forward(model, ids)
    executor = LayerwiseExecutor(model)
    executor.adapter = dataclasses.replace(executor.adapter, windows=(None,) * executor.num_layers)
    windowless = executor.run(CallPlan.all_compute(ids)).logits_last
    assert (windowless - dense_logits[-1]).abs().max() > 100 * ATOL


def test_gemma3_layers_get_their_own_window_and_rotary() -> None:
    adapter = DecoderAdapter.from_model(make_model("gemma3"))
    assert adapter.windows == (GEMMA_WINDOW, GEMMA_WINDOW, None, GEMMA_WINDOW)
    assert adapter.rotary_per_layer_type
    assert not DecoderAdapter.from_model(make_model("llama")).rotary_per_layer_type


@pytest.mark.parametrize("arch", ARCHS)
def test_dynamic_cache_continues_generation(arch: str) -> None:
    """Decoding the next token on the exported cache equals dense over prompt + token."""
    model = make_model(arch)
    ids = make_prompt(3 * GEMMA_WINDOW)
    result = LayerwiseExecutor(model).run(CallPlan.all_compute(ids))
    next_id = int(result.logits_last.argmax())
    dense_logits, _ = dense_forward(model, (*ids, next_id))
    for cache in (result.kv.to_dynamic_cache(), result.kv.to_dynamic_cache(like_model=model)):
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([[next_id]]), position_ids=torch.tensor([[len(ids)]]),
                        **cache_kwarg(model, cache), use_cache=True)  # fmt: skip
        torch.testing.assert_close(out.logits[0, -1].float(), dense_logits[-1], atol=ATOL, rtol=0)


def test_unsupported_attention_implementation_is_refused() -> None:
    model = make_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        LayerwiseExecutor(model)


@settings(max_examples=40, deadline=None)
@given(
    num_queries=st.integers(1, 12),
    num_keys=st.integers(1, 24),
    offset=st.integers(0, 1000),
    window=st.one_of(st.none(), st.integers(1, 8)),
)
def test_mask_matches_hf_mask_functions(
    num_queries: int, num_keys: int, offset: int, window: int | None
) -> None:
    """allowed_keys equals HF's causal (+ sliding overlay) predicate on positions."""
    queries = torch.randperm(num_keys)[: min(num_queries, num_keys)] + offset
    keys = torch.arange(num_keys) + offset
    predicate = masking_utils.causal_mask_function
    if window is not None:
        predicate = masking_utils.and_masks(predicate, masking_utils.sliding_window_overlay(window))
    expected = predicate(0, 0, queries[:, None], keys[None, :])  # elementwise on tensors
    assert torch.equal(allowed_keys(queries, keys, window), expected)
    mask = additive_mask(queries, keys, window, torch.float32)
    assert mask.shape == (1, 1, len(queries), num_keys)
    assert torch.equal(mask[0, 0] == 0, expected)
