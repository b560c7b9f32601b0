"""The tokens being computed at the current layer: their slots, residual stream and layer inputs.

Owns `TokenSlots` (a sorted set of prompt slots with a fast path for contiguous runs;
slot i of a plan holds the token at RoPE position `position_offset + i`), the active
set as it grows (spans joining at their start layer) and shrinks (a subset rule), and
the per-set inputs every layer needs: position ids, rotary (cos, sin) per layer type,
and the explicit position-causal additive mask per window (what a decoder layer
receives in place of the one `create_causal_mask` would build). It does not run layers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvsplice.client.model.model_adapter import DecoderAdapter

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


def allowed_keys(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Which keys each query may attend to: [N, K] bool.

    query_positions: [N] long; key_positions: [K] long (absolute RoPE positions).
    A query at p sees a key at p' iff p' <= p and, for a sliding layer,
    p - p' < window (HF's `sliding_window_overlay`: kv_idx > q_idx - window).
    """
    diff = query_positions[:, None] - key_positions[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    return allowed


def additive_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The mask eager and SDPA attention add to q·kᵀ: [1, 1, N, K] of 0 or finfo(dtype).min.

    The finite minimum (not -inf) follows HF's eager masks: a row is never all
    -inf, so softmax cannot produce NaN.
    """
    allowed = allowed_keys(query_positions, key_positions, window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


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
