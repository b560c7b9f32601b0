"""Applying a `SubsetRule` at its check layer: ask the selector, decide which K/V to write.

Owns the bookkeeping between a selector's candidate-relative indices and the
active tokens of the layer. Which tokens are worth recomputing is the
selector's (a policy's) business, not this module's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvsplice.client.execute.kv_buffer import KVBuffer
from kvsplice.client.execute.plan import SubsetRule
from kvsplice.client.execute.slots import TokenSlots

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
