"""The engine's caches in layer order: token-major K/V into blocks and back, kernel blocks too."""

from __future__ import annotations

import pytest
import torch
from helpers.vllm_worker import BLOCK, DIM, HEADS, synthetic_layout

from kvsplice.integrations.vllm.block_layout import UnsupportedLayout
from kvsplice.integrations.vllm.paged_caches import PagedCaches, layer_index


def caches(num_layers: int = 2, num_blocks: int = 8) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(num_blocks, HEADS, BLOCK, 2 * DIM)
        for i in reversed(range(num_layers))  # vLLM's dict order is not the layers'
    }


def test_layers_are_in_layer_order_and_names_without_one_are_refused() -> None:
    named = caches(3)
    paged = PagedCaches(named, synthetic_layout(), BLOCK)
    assert all(paged.caches[i] is named[f"model.layers.{i}.self_attn.attn"] for i in range(3))
    assert layer_index("model.layers.12.mlp") == 12
    with pytest.raises(ValueError, match="layer index"):
        layer_index("lm_head")


def test_scattered_tokens_come_back_out_of_the_same_blocks() -> None:
    paged = PagedCaches(caches(), synthetic_layout(), BLOCK)
    keys, values = paged.token_buffers(2 * BLOCK)
    keys.copy_(torch.randn(keys.shape))
    values.copy_(torch.randn(values.shape))
    paged.scatter((6, 1), keys, values)
    layout = synthetic_layout()
    for layer, blocks in enumerate(paged.copy_out((6, 1))):
        k, v = layout.tokens(blocks)
        assert torch.equal(k, keys[layer]) and torch.equal(v, values[layer])


def test_a_vllm_block_of_several_kernel_blocks_moves_them_all() -> None:
    paged = PagedCaches(caches(), synthetic_layout(), 2 * BLOCK)  # 2 kernel blocks per block
    keys, values = paged.token_buffers(2 * BLOCK)
    keys.fill_(1.0)
    values.fill_(2.0)
    paged.scatter((2,), keys, values)
    touched = [i for i in range(8) if paged.caches[0][i].abs().sum() > 0]
    assert touched == [4, 5] and len(paged.copy_out((2,))[0]) == 2


def test_layers_of_different_shapes_are_refused() -> None:
    named = caches()
    named["model.layers.1.self_attn.attn"] = torch.zeros(8, 1, BLOCK, 2 * DIM)
    with pytest.raises(UnsupportedLayout, match="different KV cache shapes"):
        PagedCaches(named, synthetic_layout(), BLOCK)
