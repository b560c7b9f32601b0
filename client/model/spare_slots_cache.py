"""A batch-1 HF cache built in one preallocated K and V buffer, with spare slots to grow into.

Owns `SpareSlotsCache` and its layer. Every layer holds a token prefix of its slice of one
[L, 1, H_kv, T_cap, D] buffer per K and V: reused K/V are written into the slots in place
(`append_in_place`, all layers in one pass), and the model's own `update` copies its new
tokens into the next slots, where a `DynamicCache` would concatenate (a copy of the whole
layer per forward). Attention sees the same prefix shapes a `DynamicCache` gives it. It
does not allocate the buffers (`kv_buffer_pool`) and knows nothing about segments or RoPE.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

logger = logging.getLogger(__name__)


class SpareSlotsLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are the first T slots of buffers [1, H_kv, T_cap, D].

    NOTE: while `keys` is a prefix of the buffer, `update` writes into the next slots; past
    T_cap it moves to buffers of twice the capacity (one copy, amortized). Anything that
    replaced `keys` by another tensor (beam reordering, a concatenation) leaves the buffer:
    `update` then concatenates as a `DynamicLayer` does, so the layer is never wrong, only
    slower.
    """

    def __init__(self, keys_buffer: torch.Tensor, values_buffer: torch.Tensor) -> None:
        super().__init__()
        self._buffers = (keys_buffer, values_buffer)
        self.lazy_initialization(keys_buffer, values_buffer)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = self._buffers[0].device
        self.hold(0)
        self.is_initialized = True

    def hold(self, num_tokens: int) -> None:
        """Hold the buffers' first `num_tokens` slots (written by the caller) as the layer's K/V."""
        keys_buffer, values_buffer = self._buffers
        if num_tokens > keys_buffer.shape[-2]:
            raise ValueError(f"{num_tokens} tokens exceed the buffer's {keys_buffer.shape[-2]}")
        self.keys, self.values = keys_buffer[:, :, :num_tokens], values_buffer[:, :, :num_tokens]

    def in_buffer(self) -> bool:
        """Whether keys and values are still a prefix of this layer's buffers."""
        return all(
            held is not None and _is_prefix(held, buffer)
            for held, buffer in zip((self.keys, self.values), self._buffers, strict=True)
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states, value_states: [1, H_kv, t, D]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None
        if not (self.in_buffer() and self._fits(key_states, value_states)):
            return super().update(key_states, value_states, *args, **kwargs)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self._buffers[0].shape[-2]:
            self._grow(end)
        self._buffers[0][:, :, start:end].copy_(key_states)
        self._buffers[1][:, :, start:end].copy_(value_states)
        self.hold(end)
        return self.keys, self.values  # type: ignore[return-value]

    def _fits(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        return all(
            new.dtype == buffer.dtype
            and new.device == buffer.device
            and new.shape[:2] == buffer.shape[:2]
            and new.shape[-1] == buffer.shape[-1]
            for new, buffer in zip((key_states, value_states), self._buffers, strict=True)
        )

    def _grow(self, num_tokens: int) -> None:
        """Move to buffers of at least twice the capacity (the held prefix copied once)."""
        assert self.keys is not None and self.values is not None
        held = self.keys.shape[-2]
        capacity = max(num_tokens, 2 * self._buffers[0].shape[-2])
        grown = []
        for buffer, prefix in zip(self._buffers, (self.keys, self.values), strict=True):
            shape = (*buffer.shape[:2], capacity, buffer.shape[-1])
            new = torch.empty(shape, dtype=buffer.dtype, device=buffer.device)
            new[:, :, :held].copy_(prefix)
            grown.append(new)
        self._buffers = (grown[0], grown[1])
        self.hold(held)


def _is_prefix(held: torch.Tensor, buffer: torch.Tensor) -> bool:
    return (
        held.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        and held.storage_offset() == buffer.storage_offset()  # (an empty view's data_ptr is 0)
        and held.stride() == buffer.stride()
        and held.shape[:2] == buffer.shape[:2]
        and held.shape[-1] == buffer.shape[-1]
    )


def _holds_prefix(layer: SpareSlotsLayer, keys: torch.Tensor, values: torch.Tensor) -> bool:
    return (
        layer.keys is not None
        and layer.values is not None
        and _is_prefix(layer.keys, keys)
        and _is_prefix(layer.values, values)
    )


class SpareSlotsCache(DynamicCache):
    """A `DynamicCache` of `SpareSlotsLayer`s over one K and one V buffer [L, 1, H_kv, T_cap, D]."""

    def __init__(self, keys_buffer: torch.Tensor, values_buffer: torch.Tensor) -> None:
        super().__init__()
        if keys_buffer.shape != values_buffer.shape or keys_buffer.dim() != 5:
            raise ValueError(
                f"K/V buffers {tuple(keys_buffer.shape)}, {tuple(values_buffer.shape)} must "
                "both be [L, 1, H_kv, T_cap, D]"
            )
        self._spare_layers = tuple(map(SpareSlotsLayer, keys_buffer, values_buffer))
        self.layers.extend(self._spare_layers)
        self._all_layers = (keys_buffer, values_buffer)

    def append_in_place(
        self, num_tokens: int, write: Callable[[torch.Tensor, torch.Tensor], None]
    ) -> None:
        """Append `num_tokens` to every layer by `write(keys_out, values_out)`, which fills
        views [L, H_kv, num_tokens, D] of the next slots of all layers at once.

        Raises ValueError when the slots are not there (the layers left their buffers, or
        hold different lengths, or the tokens exceed the capacity): nothing is written.
        """
        keys_buffer, values_buffer = self._all_layers
        layers = self._spare_layers
        same_layers = len(self.layers) == len(layers) and all(
            map(operator.is_, self.layers, layers)
        )
        if not (same_layers and all(map(_holds_prefix, layers, keys_buffer, values_buffer))):
            raise ValueError("the cache's layers no longer hold their preallocated buffers")
        starts = {layer.get_seq_length() for layer in layers}
        if len(starts) != 1:
            raise ValueError(f"the cache's layers hold different lengths {sorted(starts)}")
        start = starts.pop()
        if start + num_tokens > keys_buffer.shape[-2]:
            raise ValueError(
                f"{start} + {num_tokens} tokens exceed the buffer's {keys_buffer.shape[-2]} slots"
            )
        slots = slice(start, start + num_tokens)
        write(keys_buffer[:, 0, :, slots], values_buffer[:, 0, :, slots])
        for layer in layers:
            layer.hold(start + num_tokens)
