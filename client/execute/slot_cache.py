"""The object handed to HF attention as `past_key_values`: writes K/V at token slots.

HF v5 attention (Llama, Qwen2, Gemma3, ...) only calls
`past_key_values.update(key_states, value_states, layer_idx)` and attends to
what it returns. This duck-typed cache writes the computed tokens' K/V into the
full-length buffer at their slots and returns every slot of the layer, so the
model's own attention runs over reused + computed K/V. It owns no mask.

Also owns applying a `SubsetRule` at its check layer (`PendingSelection`): the
bookkeeping between a selector's candidate-relative indices and the active tokens
of the layer. Which tokens are worth recomputing is the selector's (a policy's).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvsplice.client.execute.active import TokenSlots
from kvsplice.client.execute.kv_buffer import KVBuffer
from kvsplice.client.execute.plan import SubsetRule

logger = logging.getLogger(__name__)


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
