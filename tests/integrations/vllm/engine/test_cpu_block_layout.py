"""The CPU layout probed from vLLM's own cache-write op reads back what the op wrote."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from kvsplice.integrations.vllm.block_layout import CpuBlockLayout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_probed_layout_inverts_vllms_cpu_cache_write(dtype: torch.dtype) -> None:
    heads, block, dim, blocks = 3, 128, 64, 6
    isa = _get_attn_isa(dtype, block, dim, "auto")
    cache = torch.zeros(blocks, heads, block, 2 * dim, dtype=dtype)
    layout = CpuBlockLayout.probe(cache, isa)
    k_cache, v_cache = cache.view(blocks, heads, 2 * block, dim).chunk(2, dim=2)
    k = torch.randn(3 * block, heads, dim).to(dtype)
    v = torch.randn(3 * block, heads, dim).to(dtype)
    ids = torch.tensor([4, 1, 2])
    slots = (ids.view(-1, 1) * block + torch.arange(block)).reshape(-1)
    ops.cpu_attn_reshape_and_cache(
        k, v, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )
    got_k, got_v = layout.gather(cache, ids)
    assert torch.equal(got_k, k.transpose(0, 1)) and torch.equal(got_v, v.transpose(0, 1))
    again = torch.zeros_like(cache)
    layout.scatter(again, ids, got_k, got_v)
    assert torch.equal(again, cache)
