"""Appending several reused runs at once equals appending them one by one; the cache keyword."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from kvsplice.client.model.hf_cache import (
    append_layer_runs,
    append_layers,
    cache_kwarg,
    full_length_cache,
    layer_kv,
)


def make_runs(lengths: tuple[int, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    keys = [torch.randn(3, 2, n, 4) for n in lengths]
    return keys, [torch.randn_like(k) for k in keys]


def test_runs_in_one_copy_equal_runs_one_by_one_after_existing_tokens() -> None:
    head_k, head_v = make_runs((2,))
    keys, values = make_runs((3, 1, 4))
    expected, got = full_length_cache(), full_length_cache()
    for cache in (expected, got):
        append_layers(cache, head_k[0], head_v[0])
    for k, v in zip(keys, values, strict=True):
        append_layers(expected, k, v)
    append_layer_runs(got, keys, values)
    assert got.get_seq_length() == expected.get_seq_length() == 10
    for layer in range(3):
        for a, b in zip(layer_kv(got, layer), layer_kv(expected, layer), strict=True):
            assert torch.equal(a, b)


def test_the_cache_never_aliases_the_runs() -> None:
    keys, values = make_runs((5,))
    cache = full_length_cache()
    append_layer_runs(cache, keys, values)
    cache_k, _ = layer_kv(cache, 0)
    keys[0][0].zero_()
    assert cache_k.abs().sum() > 0


class _NewStyleLayer(torch.nn.Module):
    def forward(self, hidden: torch.Tensor, cache: object = None) -> torch.Tensor:
        return hidden


class _OldStyleLayer(torch.nn.Module):
    def forward(self, hidden: torch.Tensor, past_key_values: object = None) -> torch.Tensor:
        return hidden


def test_the_cache_goes_by_the_keyword_the_module_takes() -> None:
    kv = DynamicCache()
    assert cache_kwarg(_NewStyleLayer(), kv) == {"cache": kv}
    assert cache_kwarg(_OldStyleLayer(), kv) == {"past_key_values": kv}
