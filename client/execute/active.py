"""The tokens being computed at the current layer, their residual stream and layer inputs.

Owns the active set as it grows (spans joining at their start layer) and
shrinks (a subset rule), plus the per-set inputs every layer needs: position
ids, rotary (cos, sin) per layer type, and the additive mask per window. It
does not run layers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvsplice.client.execute.attention_mask import additive_mask
from kvsplice.client.execute.slots import TokenSlots
from kvsplice.client.model.model_adapter import DecoderAdapter

logger = logging.getLogger(__name__)


class ActiveTokens:
    """Active slots and their hidden states h: [1, N, hidden], in slot order.

    `parked` [T, hidden] holds every token's latest residual state: the initial
    state of tokens that have not joined yet, and the state of tokens that
    left the set (a subset rule) or are between set changes.
    """

    def __init__(self, adapter: DecoderAdapter, parked: torch.Tensor, position_offset: int) -> None:
        self._adapter = adapter
        self._parked = parked
        self._offset = position_offset
        self._key_positions = torch.arange(parked.shape[0], device=parked.device) + position_offset
        self.slots = TokenSlots.of((), parked.device)
        self.h = parked[:0].unsqueeze(0)
        self._inputs: _SetInputs | None = None

    def __len__(self) -> int:
        return len(self.slots)

    def join(self, new_slots: Iterable[int]) -> None:
        """Add tokens whose computation starts at this layer (their parked state enters)."""
        new_slots = tuple(new_slots)
        if not new_slots:
            return
        self.slots.put(self._parked, self.h[0], dim=0)
        self.slots = self.slots.union(new_slots)
        self.h = self.slots.take(self._parked, dim=0).unsqueeze(0)
        self._inputs = None

    def keep(self, local: torch.Tensor) -> None:
        """Keep only active tokens `local` ([N'] ascending indices into the active set)."""
        self.slots.put(self._parked, self.h[0], dim=0)
        self.slots = TokenSlots.of([self.slots.ids[i] for i in local.tolist()], self._parked.device)
        self.h = self.h[:, local]
        self._inputs = None

    def states(self) -> torch.Tensor:
        """h as [N, hidden] (a fresh tensor, safe to keep)."""
        return self.h[0].clone()

    def layer_inputs(self, layer: int) -> dict[str, object]:
        """Keyword arguments for decoder layer `layer`, besides hidden states and the cache."""
        if self._inputs is None:
            self._inputs = self._build_inputs()
        return {
            "attention_mask": self._inputs.masks[self._adapter.windows[layer]],
            "position_ids": self._inputs.position_ids,
            "position_embeddings": self._inputs.rotary[self._adapter.layer_types[layer]],
        }

    def _build_inputs(self) -> _SetInputs:
        positions = (self.slots.index + self._offset).unsqueeze(0)
        masks = {
            window: additive_mask(positions[0], self._key_positions, window, self.h.dtype)
            for window in set(self._adapter.windows)
        }
        rotary = self._adapter.position_embeddings(self.h, positions)
        return _SetInputs(positions, rotary, masks)


@dataclass(frozen=True, eq=False)
class _SetInputs:
    """Layer inputs that depend only on the active set, built once per set.

    position_ids: [1, N] long; rotary: layer type -> (cos, sin) [1, N, D];
    masks: window (None = full) -> additive mask [1, 1, N, T].
    """

    position_ids: torch.Tensor
    rotary: dict[str, tuple[torch.Tensor, torch.Tensor]]
    masks: dict[int | None, torch.Tensor]
