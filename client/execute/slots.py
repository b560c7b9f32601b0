"""A sorted set of prompt slots (token indices) with a fast path for contiguous runs.

Owns only indexing: gathering and scattering along a token dimension. Slot i
of a plan holds the token at RoPE position `position_offset + i`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class TokenSlots:
    """Distinct slots in ascending order, on the host (`ids`) and the device (`index` [N] long).

    `run` is (start, end) when the slots are exactly start .. end - 1, so gathers
    and scatters become views and slice copies.
    """

    ids: tuple[int, ...]
    index: torch.Tensor
    run: tuple[int, int] | None

    @classmethod
    def of(cls, slots: Iterable[int], device: torch.device | str) -> TokenSlots:
        ids = tuple(sorted({int(s) for s in slots}))
        if ids and ids[0] < 0:
            raise ValueError(f"slot {ids[0]} is negative")
        index = torch.tensor(ids, dtype=torch.long, device=device)
        contiguous = bool(ids) and ids[-1] - ids[0] + 1 == len(ids)
        return cls(ids, index, (ids[0], ids[-1] + 1) if contiguous else None)

    def __len__(self) -> int:
        return len(self.ids)

    def union(self, other: Iterable[int]) -> TokenSlots:
        return TokenSlots.of((*self.ids, *other), self.index.device)

    def take(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """x restricted to these slots along `dim` (a view for a contiguous run)."""
        if self.run is not None:
            return x.narrow(dim, self.run[0], self.run[1] - self.run[0])
        return x.index_select(dim, self.index)

    def put(self, dst: torch.Tensor, src: torch.Tensor, dim: int) -> None:
        """dst[..., slots, ...] = src along `dim` (src has len(self) entries there)."""
        if self.run is not None:
            dst.narrow(dim, self.run[0], self.run[1] - self.run[0]).copy_(src)
        else:
            dst.index_copy_(dim, self.index, src)
