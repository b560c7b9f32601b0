"""Oracles for subset rules (CacheBlend-style selective recompute) in the layerwise executor."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from helpers.layerwise import NUM_LAYERS, dense_forward, dense_kv, make_model, make_prompt
from transformers import PreTrainedModel

from kvsplice.client.execute.capture import capture_segments
from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.execute.plan import CallPlan, KVPair, PlanSpan, SubsetRule
from kvsplice.kvmath.segment_kv import SegmentKV

ATOL = 1e-4  # measured max |Δlogit| <= 9e-8 (select-all vs dense), 0.0 (select-none vs reuse)
CHUNK = (4, 12)  # the reused chunk inside a 16-token prompt
NUM_TOKENS = 16


@dataclass
class RecordingSelector:
    """Keeps the candidates `pick` names and records what it was shown."""

    pick: tuple[int, ...] | None = None  # None: all candidates
    calls: list[tuple[int, KVPair, KVPair]] = field(default_factory=list)

    def __call__(self, layer_idx: int, new_kv: KVPair, old_kv: KVPair) -> torch.Tensor:
        self.calls.append((layer_idx, new_kv, old_kv))
        if self.pick is None:
            return torch.arange(new_kv[0].shape[1])
        return torch.tensor(self.pick, dtype=torch.long)


def isolated_chunk_kv(
    model: PreTrainedModel, ids: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's K/V prefilled alone at its target positions (what a chunk cache holds)."""
    start, end = CHUNK
    segment = capture_segments(
        model, ids[start:end], [(0, end - start)], position_offset=start
    ).segments[0]
    return segment.keys, segment.values


def blend_plan(
    model: PreTrainedModel, ids: tuple[int, ...], check_layer: int, selector: RecordingSelector,
    start_layer: int = 0,
) -> CallPlan:  # fmt: skip
    keys, values = isolated_chunk_kv(model, ids)
    start, end = CHUNK
    spans = (
        PlanSpan(0, start, name="prefix"),
        PlanSpan(start, end, start_layer, SegmentKV(keys, values, start), name="chunk"),
        PlanSpan(end, len(ids), name="query"),
    )
    return CallPlan(ids, spans, subsets=(SubsetRule(check_layer, selector),))


@pytest.mark.parametrize("check_layer", [0, 1, NUM_LAYERS - 1])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_selecting_all_tokens_equals_dense(arch: str, check_layer: int) -> None:
    model = make_model(arch)
    ids = make_prompt(NUM_TOKENS)
    dense_logits, _ = dense_forward(model, ids)
    result = LayerwiseExecutor(model).run(blend_plan(model, ids, check_layer, RecordingSelector()))
    torch.testing.assert_close(result.logits_last, dense_logits[-1], atol=ATOL, rtol=0)
    assert result.kept_slots[check_layer] == tuple(range(NUM_TOKENS))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_selecting_nothing_at_layer_0_equals_plain_reuse(arch: str) -> None:
    """No token kept at check layer 0: the chunk's old K/V serve every layer (naive reuse)."""
    model = make_model(arch)
    ids = make_prompt(NUM_TOKENS)
    executor = LayerwiseExecutor(model)
    blended = executor.run(blend_plan(model, ids, 0, RecordingSelector(pick=())))
    reused = executor.run(blend_plan(model, ids, 0, RecordingSelector(), start_layer=NUM_LAYERS))
    torch.testing.assert_close(blended.logits_last, reused.logits_last, atol=ATOL, rtol=0)
    torch.testing.assert_close(blended.kv.keys, reused.kv.keys, atol=ATOL, rtol=0)


def test_selector_sees_candidates_new_and_old_kv() -> None:
    """At check layer 1 after a dense layer 0, new K/V are dense K/V; old are the provided ones."""
    model = make_model("llama")
    ids = make_prompt(NUM_TOKENS)
    _, cache = dense_forward(model, ids)
    selector = RecordingSelector()
    LayerwiseExecutor(model).run(blend_plan(model, ids, 1, selector))
    (layer, (new_k, new_v), (old_k, old_v)), = selector.calls  # fmt: skip
    start, end = CHUNK
    num_kv_heads, head_dim = model.config.num_key_value_heads, model.config.head_dim
    assert layer == 1
    assert new_k.shape == new_v.shape == old_k.shape == (num_kv_heads, end - start, head_dim)
    dense_keys, dense_values = dense_kv(cache, start, end)
    torch.testing.assert_close(new_k, dense_keys[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(new_v, dense_values[1], atol=ATOL, rtol=0)
    old_keys, old_values = isolated_chunk_kv(model, ids)
    assert torch.equal(old_k, old_keys[1]) and torch.equal(old_v, old_values[1])


def test_dropped_tokens_keep_old_kv_from_the_check_layer_on() -> None:
    model = make_model("qwen2")
    ids = make_prompt(NUM_TOKENS)
    start, end = CHUNK
    check = 1
    result = LayerwiseExecutor(model).run(
        blend_plan(model, ids, check, RecordingSelector(pick=(5, 1)))
    )
    kept_chunk = (start + 1, start + 5)
    assert result.kept_slots[check] == (*range(start), *kept_chunk, *range(end, NUM_TOKENS))
    assert result.num_computed == (NUM_TOKENS, NUM_TOKENS, NUM_TOKENS - 6, NUM_TOKENS - 6)
    old_keys, _ = isolated_chunk_kv(model, ids)
    dropped = [s for s in range(start, end) if s not in kept_chunk]
    for layer in range(check, NUM_LAYERS):
        for slot in dropped:
            assert torch.equal(result.kv.keys[layer, :, slot], old_keys[layer, :, slot - start])
        for slot in kept_chunk:
            assert not torch.equal(result.kv.keys[layer, :, slot], old_keys[layer, :, slot - start])


def test_logits_token_is_never_a_candidate() -> None:
    """A reused chunk that ends the prompt still computes its last token through every layer."""
    model = make_model("llama")
    ids = make_prompt(10)
    segment = capture_segments(model, ids[4:], [(0, 6)], position_offset=4).segments[0]
    selector = RecordingSelector(pick=())
    spans = (PlanSpan(0, 4), PlanSpan(4, 10, 0, segment))
    plan = CallPlan(ids, spans, subsets=(SubsetRule(1, selector),))
    result = LayerwiseExecutor(model).run(plan)
    assert selector.calls[0][1][0].shape[1] == 5
    assert result.kept_slots[1] == (0, 1, 2, 3, 9)


def test_out_of_range_selection_is_refused() -> None:
    model = make_model("llama")
    ids = make_prompt(NUM_TOKENS)
    with pytest.raises(ValueError, match="outside"):
        LayerwiseExecutor(model).run(blend_plan(model, ids, 1, RecordingSelector(pick=(99,))))
