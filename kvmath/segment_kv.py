"""In-memory tensors of one segment: per-layer K/V and optional boundary states.

This is what capture produces, what the payload format encodes and decodes,
and what splice consumes. It owns no I/O and no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SegmentKV:
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
    def num_layers(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[2])

    @property
    def layer_end(self) -> int:
        return self.layer_start + self.num_layers
