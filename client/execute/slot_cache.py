"""The object handed to HF attention as `past_key_values`: writes K/V at token slots.

HF v5 attention (Llama, Qwen2, Gemma3, ...) only calls
`past_key_values.update(key_states, value_states, layer_idx)` and attends to
what it returns. This duck-typed cache writes the computed tokens' K/V into the
full-length buffer at their slots and returns every slot of the layer, so the
model's own attention runs over reused + computed K/V. It owns no mask.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvsplice.client.execute.kv_buffer import KVBuffer
from kvsplice.client.execute.slots import TokenSlots
from kvsplice.client.execute.subset import PendingSelection

logger = logging.getLogger(__name__)


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
