"""Transformers' cache objects (v5 layer API), read and written; the splice path's
preallocated cache is `spare_slots_cache`'s.

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
from transformers.cache_utils import CacheLayerMixin

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
