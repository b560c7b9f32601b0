"""In-memory tensors of one segment: per-layer K/V and optional boundary states.

This is what capture produces, what the payload format encodes and decodes,
and what splice consumes. It owns no I/O and no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class LayeredKV:
    """K/V laid out [L, H_kv, T, D] (layers, KV heads, tokens, head dim): the axes every
    holder of a span's K/V shares (a segment's, the executor's buffer)."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def num_layers(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])


@dataclass
class SegmentKV(LayeredKV):
    """K/V of `T` tokens for layers `[layer_start, layer_start + L)`.

    keys:   [L, H_kv, T, D], post-RoPE, rotated for positions
            `start_position .. start_position + T - 1`.
    values: [L, H_kv, T, D].
    boundary_states: cut layer l -> [T, hidden], the residual stream entering
            decoder layer l (l == num_layers means the final norm's input).
    """

    keys: torch.Tensor
    values: torch.Tensor
    start_position: int
    layer_start: int = 0
    boundary_states: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.keys.dim() != 4 or self.keys.shape != self.values.shape:
            raise ValueError(
                f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} "
                "must both be [L, H_kv, T, D]"
            )
        if self.start_position < 0 or self.layer_start < 0:
            raise ValueError(
                f"start_position {self.start_position} / layer_start {self.layer_start} < 0"
            )
        for layer, state in self.boundary_states.items():
            if state.dim() != 2 or state.shape[0] != self.num_tokens:
                raise ValueError(
                    f"boundary state at layer {layer} must be [T={self.num_tokens}, hidden]"
                )

    @property
    def layer_end(self) -> int:
        return self.layer_start + self.num_layers

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        num_layers, num_heads, num_tokens, head_dim = self.keys.shape
        return num_layers, num_heads, num_tokens, head_dim

    @property
    def nbytes(self) -> int:
        states = sum(s.nbytes for s in self.boundary_states.values())
        return self.keys.nbytes + self.values.nbytes + states

    def decode(self, dtype: torch.dtype = torch.float32) -> SegmentKV:
        """Itself with its tensors in `dtype` (no copy of those already in it)."""
        states = {layer: s.to(dtype) for layer, s in self.boundary_states.items()}
        return SegmentKV(
            self.keys.to(dtype),
            self.values.to(dtype),
            self.start_position,
            self.layer_start,
            states,
        )

    def tokens(self, start: int, end: int) -> SegmentKV:
        """Tokens [start, end) (indices within the segment) at their own positions: views."""
        if not 0 <= start < end <= self.num_tokens:
            raise ValueError(
                f"slice [{start}, {end}) outside the segment's {self.num_tokens} tokens"
            )
        states = {layer: s[start:end] for layer, s in self.boundary_states.items()}
        return SegmentKV(
            self.keys[:, :, start:end],
            self.values[:, :, start:end],
            self.start_position + start,
            self.layer_start,
            states,
        )
