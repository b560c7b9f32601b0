"""What a layerwise run returns: logits, the filled K/V buffer, captured hidden states.

Owns the result types only; the executor builds them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvsplice.client.execute.kv_buffer import KVBuffer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class CapturedStates:
    """The residual stream entering one layer, for the tokens computed there.

    slots: ascending prompt slots; states: [len(slots), hidden].
    """

    slots: tuple[int, ...]
    states: torch.Tensor

    def span(self, start: int, end: int) -> torch.Tensor:
        """States of slots [start, end): [end - start, hidden]; ValueError if any was not computed."""
        try:
            first = self.slots.index(start)
        except ValueError:
            raise ValueError(f"slot {start} was not computed at this layer") from None
        if self.slots[first : first + end - start] != tuple(range(start, end)):
            raise ValueError(f"slots [{start}, {end}) were not all computed at this layer")
        return self.states[first : first + end - start]


@dataclass(frozen=True, eq=False)
class LayerwiseResult:
    """logits: [len(logits_slots), V] float32, rows in `logits_slots` (ascending) order.

    kv: every slot's K/V at every layer after the run (reused + computed).
    hidden_states: capture layer -> states of the tokens computed there.
    kept_slots: check layer -> slots still computed after its subset rule.
    num_computed: per layer, how many tokens ran through it (FLOPs accounting).
    """

    logits: torch.Tensor
    logits_slots: tuple[int, ...]
    kv: KVBuffer
    hidden_states: dict[int, CapturedStates]
    kept_slots: dict[int, tuple[int, ...]]
    num_computed: tuple[int, ...]

    @property
    def logits_last(self) -> torch.Tensor:
        """[V] float32: the highest requested slot's logits (the last prompt token by default)."""
        return self.logits[-1]
