"""Block layouts: vLLM's paged blocks <-> token-major K/V, by their definitions.

The CPU layout is learnt by probing vLLM's cache-write op (the engine test folder runs
the real op); here a simulated op with K transposed per block stands in for it.
"""

from __future__ import annotations

import pytest
import torch

from kvsplice.integrations.vllm.block_layout import CpuBlockLayout, FlashBlockLayout

H, BS, D = 3, 8, 4


def test_flash_gather_reads_each_token_where_the_flash_layout_puts_it() -> None:
    cache = torch.randn(2, 5, BS, H, D)  # [K|V, blocks, block_size, heads, dim]
    layout = FlashBlockLayout(BS, H, D)
    k, v = layout.gather(cache, torch.tensor([3, 1]))
    assert k.shape == (H, 2 * BS, D)
    assert torch.equal(k[:, :BS], cache[0, 3].transpose(0, 1))
    assert torch.equal(v[:, BS:], cache[1, 1].transpose(0, 1))


def test_flash_scatter_then_gather_is_the_identity_and_touches_nothing_else() -> None:
    cache = torch.zeros(2, 5, BS, H, D)
    layout = FlashBlockLayout(BS, H, D)
    k, v = torch.randn(H, 2 * BS, D), torch.randn(H, 2 * BS, D)
    layout.scatter(cache, torch.tensor([4, 0]), k, v)
    assert torch.equal(torch.stack(layout.gather(cache, torch.tensor([4, 0]))), torch.stack([k, v]))
    assert cache[:, 1:4].abs().sum() == 0


@pytest.mark.gpu
def test_flash_layout_on_cuda() -> None:
    cache = torch.zeros(2, 6, BS, H, D, device="cuda", dtype=torch.bfloat16)
    layout = FlashBlockLayout(BS, H, D)
    k = torch.randn(H, 3 * BS, D, dtype=torch.bfloat16)
    v = torch.randn(H, 3 * BS, D, dtype=torch.bfloat16)
    ids = torch.tensor([5, 2, 0])
    layout.scatter(cache, ids, k, v)
    got_k, got_v = layout.gather(cache, ids)
    assert torch.equal(got_k.cpu(), k) and torch.equal(got_v.cpu(), v)


def simulated_write(values: torch.Tensor) -> torch.Tensor:
    """A block as the `vec` CPU kernel writes it: per head, K as [D, BS] then V as [BS, D]."""
    block = torch.zeros(H, 2 * BS * D, dtype=torch.int64)
    for h in range(H):
        block[h, : BS * D] = values[:, h, :].transpose(0, 1).reshape(-1)  # K transposed
        block[h, BS * D :] = values[:, h, :].reshape(-1)
    return block.reshape(-1)


def test_the_cpu_layout_learnt_from_a_write_op_inverts_it() -> None:
    shape = (BS, H, D)
    coords = [
        torch.arange(n).view(*(n if i == axis else 1 for i in range(3))).expand(shape)
        for axis, n in enumerate(shape)
    ]
    where = []
    for coord in coords:
        flat = simulated_write(coord).view(H, 2, BS * D)
        unset = torch.full_like(flat[:, 0], -1)
        k_part = torch.stack([flat[:, 0], unset], dim=1).reshape(-1)
        v_part = torch.stack([unset, flat[:, 1]], dim=1).reshape(-1)
        where.append((k_part, v_part))
    layout = CpuBlockLayout._from_probes(where, H, BS, D)
    tokens_k, tokens_v = torch.randn(BS, H, D), torch.randn(BS, H, D)
    block = torch.zeros(H, 2 * BS * D)
    for h in range(H):
        block[h, : BS * D] = tokens_k[:, h].transpose(0, 1).reshape(-1)
        block[h, BS * D :] = tokens_v[:, h].reshape(-1)
    cache = torch.zeros(4, H, BS, 2 * D)
    cache[2] = block.view(H, BS, 2 * D)
    k, v = layout.gather(cache, torch.tensor([2]))
    assert torch.equal(k, tokens_k.transpose(0, 1)) and torch.equal(v, tokens_v.transpose(0, 1))
    again = torch.zeros_like(cache)
    layout.scatter(again, torch.tensor([2]), k, v)
    assert torch.equal(again, cache)
