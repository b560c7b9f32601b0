"""Full-length per-layer K/V of one prompt, written at token slots.

Owns the tensors the layerwise executor pre-fills with reused K/V and writes
computed K/V into, and their export (a v5 `DynamicCache`, a `SegmentKV`). It
knows nothing about plans or models; positions are `position_offset + slot`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from kvsplice.client.execute.active import TokenSlots
from kvsplice.client.model.hf_cache import append_layers, full_length_cache, model_cache
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class KVBuffer:
    """keys, values: [L, H_kv, T, D]; keys post-RoPE at positions `position_offset + slot`."""

    keys: torch.Tensor
    values: torch.Tensor
    position_offset: int = 0

    @classmethod
    def zeros(
        cls,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        device: torch.device | str,
        position_offset: int = 0,
    ) -> KVBuffer:
        """An unfilled buffer of shape [L, H_kv, T, D]."""
        keys = torch.zeros(shape, dtype=dtype, device=device)
        return cls(keys, torch.zeros_like(keys), position_offset)

    @property
    def num_layers(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    def key_positions(self) -> torch.Tensor:
        """[T] long: the RoPE position of every slot."""
        return torch.arange(self.num_tokens, device=self.keys.device) + self.position_offset

    def fill(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy provided K/V into layers [0, L_kv) at slots [start, start + T).

        keys, values: [L_kv, H_kv, T, D], already rotated to the slots' positions.
        """
        num_layers, _, num_tokens, _ = keys.shape
        dst = (slice(0, num_layers), slice(None), slice(start, start + num_tokens))
        self.keys[dst] = keys.to(self.keys.device, self.keys.dtype)
        self.values[dst] = values.to(self.values.device, self.values.dtype)

    def write(
        self, layer: int, slots: TokenSlots, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """keys, values: [H_kv, N, D] for the N = len(slots) slots of `layer`."""
        slots.put(self.keys[layer], keys, dim=1)
        slots.put(self.values[layer], values, dim=1)

    def gather(self, layer: int, slots: TokenSlots) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `slots` at `layer`: ([H_kv, N, D], [H_kv, N, D])."""
        return slots.take(self.keys[layer], dim=1), slots.take(self.values[layer], dim=1)

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All slots of `layer` as attention reads them: ([1, H_kv, T, D], [1, H_kv, T, D]) views."""
        return self.keys[layer].unsqueeze(0), self.values[layer].unsqueeze(0)

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of slots [start, end), all layers: fresh [L, H_kv, end - start, D] tensors."""
        return self.keys[:, :, start:end].clone(), self.values[:, :, start:end].clone()

    def to_segment(self, start: int, end: int) -> SegmentKV:
        """Slots [start, end) as a segment captured at `position_offset + start`."""
        keys, values = self.read(start, end)
        return SegmentKV(keys, values, start_position=self.position_offset + start)

    def to_dynamic_cache(self, like_model: PreTrainedModel | None = None) -> DynamicCache:
        """A v5 `DynamicCache` holding every slot, for HF `generate` or a decode loop.

        Without `like_model` every layer keeps all tokens (sliding layers are
        masked from positions by the model); with it, the cache is built the way
        `generate` builds it, so sliding layers keep only their window.
        Decoding continues at position `position_offset + num_tokens`.
        """
        cache = full_length_cache() if like_model is None else model_cache(like_model)
        append_layers(cache, self.keys, self.values)
        return cache
