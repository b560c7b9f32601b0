"""Full-length per-layer K/V of one prompt, written at token slots, and the cache HF writes through.

Owns the tensors the layerwise executor pre-fills with reused K/V and writes
computed K/V into, and their export (a v5 `DynamicCache`, a `SegmentKV`);
positions are `position_offset + slot`. Also owns `SlotWriteCache`, the object
handed to HF attention as `past_key_values`: HF v5 attention (Llama, Qwen2,
Gemma3, ...) only calls `past_key_values.update(key_states, value_states,
layer_idx)` and attends to what it returns, so this duck-typed cache writes the
computed tokens' K/V into the buffer at their slots and returns every slot of the
layer (the model's own attention runs over reused + computed K/V; it owns no mask),
and `PendingSelection`, which applies a `SubsetRule` at its check layer (which
tokens are worth recomputing is the selector's, a policy's, business).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from kvsplice.client.execute.active import TokenSlots
from kvsplice.client.execute.plan import SubsetRule
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


@dataclass(frozen=True, eq=False)
class PendingSelection:
    """A rule about to run on a layer whose N active tokens include M candidates.

    candidate_local: [M] long, positions of the candidates among the active
    tokens (ascending); candidate_slots: the same tokens as prompt slots.
    """

    rule: SubsetRule
    candidate_local: torch.Tensor
    candidate_slots: TokenSlots
    num_active: int

    def keep_local(
        self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor, buffer: KVBuffer
    ) -> torch.Tensor:
        """Active-token indices [N'] (ascending) that stay computed: non-candidates + chosen.

        new_keys, new_values: [H_kv, N, D] computed for all N active tokens at
        `layer`; the buffer still holds the candidates' old K/V there.
        """
        new_kv = (new_keys[:, self.candidate_local], new_values[:, self.candidate_local])
        # Cloned: a gather of a contiguous run is a view the write below overwrites.
        old_keys, old_values = buffer.gather(layer, self.candidate_slots)
        old_kv = (old_keys.clone(), old_values.clone())
        chosen = torch.as_tensor(self.rule.select(layer, new_kv, old_kv), dtype=torch.long)
        chosen = chosen.to(self.candidate_local.device).flatten()
        num_candidates = int(self.candidate_local.numel())
        if chosen.numel() and not bool(((chosen >= 0) & (chosen < num_candidates)).all()):
            raise ValueError(f"selector returned indices outside [0, {num_candidates})")
        keep = torch.ones(self.num_active, dtype=torch.bool, device=chosen.device)
        keep[self.candidate_local] = False
        keep[self.candidate_local[chosen]] = True
        return keep.nonzero().squeeze(1)


class SlotWriteCache:
    """Per layer: `begin_layer(slots)`, then the layer's attention calls `update` once."""

    def __init__(self, buffer: KVBuffer) -> None:
        self.buffer = buffer
        self._slots: TokenSlots | None = None
        self._selection: PendingSelection | None = None
        self.kept_local: torch.Tensor | None = None

    def begin_layer(self, slots: TokenSlots, selection: PendingSelection | None = None) -> None:
        """The next `update` carries K/V for `slots` (the layer's active tokens, in order)."""
        self._slots = slots
        self._selection = selection
        self.kept_local = None

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [1, H_kv, N, D] (keys post-RoPE) -> [1, H_kv, T, D] views.

        With a pending selection only the kept tokens' K/V are written; the
        dropped ones keep their old (provided) K/V, and `kept_local` says which
        of the N tokens were kept. Extra arguments (`cache_kwargs` before transformers
        5.24, `kwargs=` since) carry RoPE details this cache does not need.
        """
        if self._slots is None:
            raise RuntimeError("update() before begin_layer(): the executor owns this cache")
        keys, values, slots = key_states[0], value_states[0], self._slots
        if self._selection is not None:
            self.kept_local = self._selection.keep_local(layer_idx, keys, values, self.buffer)
            slots = TokenSlots.of(
                [slots.ids[i] for i in self.kept_local.tolist()], slots.index.device
            )
            keys, values = keys[:, self.kept_local], values[:, self.kept_local]
        self.buffer.write(layer_idx, slots, keys, values)
        self._slots = None  # one update per layer; a second one is a bug
        return self.buffer.layer_view(layer_idx)
