"""The only module that touches transformers' cache objects (v5 layer API).

Reads and writes per-layer K/V through `cache.layers[i].keys/.values` and
`cache.update`; the removed v4 accessors (`key_cache`, legacy tuples) are never
used. It knows nothing about segments, positions or RoPE.
"""

from __future__ import annotations

import logging

import torch
from transformers import DynamicCache, PreTrainedModel

logger = logging.getLogger(__name__)


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
    keys = torch.stack([layer.keys[0, :, start:end] for layer in cache.layers])
    values = torch.stack([layer.values[0, :, start:end] for layer in cache.layers])
    return keys, values


def append_layers(
    cache: DynamicCache, keys: torch.Tensor, values: torch.Tensor, layer_start: int = 0
) -> None:
    """Append K/V to layers `layer_start ..` of a batch-1 cache via `cache.update`.

    keys, values: [L, H_kv, T, D] in the cache's dtype and device. Sliding-window
    layers crop to their window themselves, exactly as during a dense prefill.
    """
    for offset in range(keys.shape[0]):
        cache.update(keys[offset].unsqueeze(0), values[offset].unsqueeze(0), layer_start + offset)


def cache_num_layers(cache: DynamicCache) -> int:
    return len(cache.layers)
