"""The only module that touches transformers' cache objects (v5 layer API).

Reads and writes per-layer K/V through `cache.layers[i].keys/.values` and
`cache.update`; the removed v4 accessors (`key_cache`, legacy tuples) are never
used. It knows nothing about segments, positions or RoPE.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from kvsplice.common.errors import LayoutMismatch

logger = logging.getLogger(__name__)


def cache_kwarg(module: torch.nn.Module, kv_cache: object) -> dict[str, object]:
    """`kv_cache` as the keyword `module.forward` takes it: `cache` (transformers >= 5.24,
    where `past_key_values` is deprecated) or `past_key_values` (earlier releases)."""
    return {_cache_parameter(type(module).forward): kv_cache}


@cache
def _cache_parameter(forward: Callable[..., Any]) -> str:
    parameters = inspect.signature(forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def full_length_cache() -> DynamicCache:
    """A cache whose every layer keeps all tokens, sliding-window layers included.

    Capture uses it: a `DynamicSlidingWindowLayer` would drop all but the last
    `window - 1` tokens, and the model's sliding mask is built from positions,
    so attention outputs are the same as with the model's own cache.
    """
    return DynamicCache()


def model_cache(model: PreTrainedModel) -> DynamicCache:
    """A cache shaped like the one `generate` would build (sliding layers crop)."""
    return DynamicCache(config=model.config)


def read_layers(cache: DynamicCache, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of tokens `[start, end)` from every layer of a batch-1 full-length cache.

    Returns keys, values: [L, H_kv, end - start, D] (fresh tensors, not views).
    """
    layers = [layer_kv(cache, i) for i in range(len(cache.layers))]
    keys = torch.stack([k[0, :, start:end] for k, _ in layers])
    values = torch.stack([v[0, :, start:end] for _, v in layers])
    return keys, values


def layer_kv(cache: DynamicCache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole K/V `[B, H_kv, T_layer, D]` held by one cache layer.

    Raises `LayoutMismatch` for layers that hold no K/V (linear-attention states).
    """
    layer = kv_layer(cache, layer_idx)
    keys, values = layer.keys, layer.values
    if keys is None or values is None:
        raise LayoutMismatch(f"cache layer {layer_idx} ({type(layer).__name__}) holds no K/V")
    return keys, values


def kv_layer(cache: DynamicCache, layer_idx: int) -> CacheLayerMixin:
    """The layer at `layer_idx`, one that holds K/V (linear-attention and dummy layers
    do not: `LayoutMismatch`)."""
    layer = cache.layers[layer_idx]
    if not isinstance(layer, CacheLayerMixin):
        raise LayoutMismatch(f"cache layer {layer_idx} ({type(layer).__name__}) holds no K/V")
    return layer


def append_layers(
    cache: DynamicCache, keys: torch.Tensor, values: torch.Tensor, layer_start: int = 0
) -> None:
    """Append K/V to layers `layer_start ..` of a batch-1 cache via `cache.update`.

    keys, values: [L, H_kv, T, D] in the cache's dtype and device. Sliding-window
    layers crop to their window themselves, exactly as during a dense prefill.
    """
    for offset in range(keys.shape[0]):
        cache.update(keys[offset].unsqueeze(0), values[offset].unsqueeze(0), layer_start + offset)


def install_layers(
    cache: DynamicCache, keys: torch.Tensor, values: torch.Tensor, num_tokens: int | None = None
) -> None:
    """Append K/V to every layer of a batch-1 cache, without copying them into empty layers.

    keys, values: [L, 1, H_kv, T_cap, D], contiguous per layer (e.g. one buffer the caller
    wrote in place), of which the first `num_tokens` (all by default) hold K/V. An empty
    plain `DynamicLayer` becomes a `ReservedLayer` over them (`cache.update` would
    concatenate onto an empty tensor: a second full copy), whose later updates write into
    the spare `T_cap - num_tokens` slots; other layers (holding tokens already, or sliding
    windows, which crop) take the valid tokens through `cache.update`.
    """
    num_tokens = keys.shape[-2] if num_tokens is None else num_tokens
    for layer_idx in range(keys.shape[0]):
        layer_keys, layer_values = keys[layer_idx], values[layer_idx]
        if layer_idx >= len(cache.layers):  # a full-length cache creates layers on update
            cache.update(layer_keys[:, :, :0], layer_values[:, :, :0], layer_idx)
        layer = cache.layers[layer_idx]
        if type(layer) is DynamicLayer and layer.get_seq_length() == 0:
            cache.layers[layer_idx] = ReservedLayer(layer_keys, layer_values, num_tokens)
        else:
            valid = slice(0, num_tokens)
            cache.update(layer_keys[:, :, valid], layer_values[:, :, valid], layer_idx)


class ReservedLayer(DynamicLayer):
    """A `DynamicLayer` over buffers with spare slots: updates that fit are written into them.

    keys, values: [1, H_kv, T_cap, D] buffers whose first `num_tokens` hold K/V; `self.keys`
    and `self.values` are views of their valid tokens, as `DynamicLayer`'s are the whole
    tensors. NOTE: a forward over a plain `DynamicLayer` concatenates the whole cache with
    its new tokens, one full copy of every reused K/V per forward; here a forward writes
    only its own tokens. An update past the spare slots, or after someone replaced the views
    (`truncate`, `crop`), concatenates as `DynamicLayer` does.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, num_tokens: int) -> None:
        super().__init__()
        if not 0 <= num_tokens <= keys.shape[-2]:
            raise ValueError(f"num_tokens {num_tokens} not in [0, {keys.shape[-2]}]")
        self.lazy_initialization(keys, values)
        self._key_buffer, self._value_buffer = keys, values
        self.keys, self.values = keys[:, :, :num_tokens], values[:, :, :num_tokens]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.get_seq_length(), self.get_seq_length() + key_states.shape[-2]
        if not self._views_of_buffers() or end > self._key_buffer.shape[-2]:
            return super().update(key_states, value_states, *args, **kwargs)
        self._key_buffer[:, :, start:end].copy_(key_states)
        self._value_buffer[:, :, start:end].copy_(value_states)
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values

    def _views_of_buffers(self) -> bool:
        if not self.is_initialized or self.keys is None or self.values is None:
            return False  # reset: `DynamicLayer.update` starts it again
        return (
            self.keys.data_ptr() == self._key_buffer.data_ptr()
            and self.values.data_ptr() == self._value_buffer.data_ptr()
        )


def append_layer_runs(
    cache: DynamicCache, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> None:
    """Append several runs of K/V, in order, to every layer of a batch-1 cache in one copy.

    keys[i], values[i]: [L, H_kv, T_i, D] in the cache's dtype and device. Equal to
    `append_layers` once per run, without concatenating the growing cache per run
    (or the runs first and the cache again after).
    """
    for layer_idx in range(keys[0].shape[0]):
        # A zero-length update creates (or reuses) the layer with `update`'s own rules.
        empty_k = keys[0][layer_idx, :, :0].unsqueeze(0)
        cache.update(empty_k, values[0][layer_idx, :, :0].unsqueeze(0), layer_idx)
        layer = kv_layer(cache, layer_idx)
        old_k, old_v = layer_kv(cache, layer_idx)
        layer.keys = torch.cat([old_k, *(k[layer_idx].unsqueeze(0) for k in keys)], dim=-2)
        layer.values = torch.cat([old_v, *(v[layer_idx].unsqueeze(0) for v in values)], dim=-2)


def truncate(cache: DynamicCache, num_tokens: int) -> None:
    """Keep only the first `num_tokens` of every layer of a batch-1 full-length cache.

    (Not `DynamicCache.crop`: its argument changed meaning across transformers 5.x.)
    """
    for layer_idx in range(len(cache.layers)):
        layer = kv_layer(cache, layer_idx)
        keys, values = layer_kv(cache, layer_idx)
        layer.keys, layer.values = keys[:, :, :num_tokens], values[:, :, :num_tokens]
