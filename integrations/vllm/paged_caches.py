"""The engine's paged KV caches as the worker half sees them: every layer's, in layer order.

Token-major K/V (`[L, H_kv, T, D]`) goes into a run of vLLM blocks (`scatter`) and whole
blocks come out for a save (`copy_out`), through the engine's `BlockLayout`; a vLLM block
may be several kernel blocks. Knows tensors and block ids, not the sidecar or requests.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from kvsplice.integrations.vllm.block_layout import BlockLayout, UnsupportedLayout


class PagedCaches:
    def __init__(
        self, caches: Mapping[str, torch.Tensor], layout: BlockLayout, block_size: int
    ) -> None:
        self.caches = [caches[name] for name in sorted(caches, key=layer_index)]
        _check_same_shapes(self.caches)
        self.layout = layout
        self.block_size = block_size
        self.blocks_per_block = block_size // layout.block_size  # kernel blocks per vLLM block

    @property
    def kv_dims(self) -> tuple[int, int, int]:
        """(L, H_kv, D): what a stored segment must hold to be written here."""
        return len(self.caches), self.layout.num_kv_heads, self.layout.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.caches[0].dtype

    def token_buffers(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty keys and values `[L, H_kv, num_tokens, D]` in the caches' dtype and device."""
        num_layers, num_heads, head_dim = self.kv_dims
        cache = self.caches[0]
        shape = (num_layers, num_heads, num_tokens, head_dim)
        keys = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        return keys, torch.empty_like(keys)

    def scatter(self, block_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v `[L, H_kv, len(block_ids) * block_size, D]` (any strides) into the blocks."""
        kernel_ids = self._kernel_blocks(block_ids)
        for layer, cache in enumerate(self.caches):
            self.layout.scatter(cache, kernel_ids, k[layer], v[layer])

    def copy_out(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Every layer's blocks `block_ids`, copied to the CPU in the cache's own layout."""
        kernel_ids = self._kernel_blocks(block_ids)
        return tuple(
            cache.index_select(0, kernel_ids.to(cache.device)).cpu() for cache in self.caches
        )

    def _kernel_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if self.blocks_per_block == 1:
            return ids
        offsets = torch.arange(self.blocks_per_block, dtype=torch.int64)
        return (ids.view(-1, 1) * self.blocks_per_block + offsets).reshape(-1)


def _check_same_shapes(caches: list[torch.Tensor]) -> None:
    """Every layer's cache alike: a chunk is one `[L, H_kv, T, D]` tensor."""
    shapes = {(tuple(c.shape), c.dtype) for c in caches}
    if len(shapes) > 1:
        raise UnsupportedLayout(
            f"layers have different KV cache shapes: {sorted(map(str, shapes))}"
        )


def layer_index(layer_name: str) -> int:
    """The decoder layer a vLLM attention layer name belongs to (`model.layers.12.self_attn.attn`)."""
    numbers = re.findall(r"\.(\d+)\.", f".{layer_name}.")
    if not numbers:
        raise ValueError(f"cannot tell the layer index of {layer_name!r}")
    return int(numbers[0])
