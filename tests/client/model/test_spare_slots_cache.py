"""`SpareSlotsCache` holds what a `DynamicCache` holds after the same updates, in place; the
pool hands a buffer out again only when nothing holds a view of it."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvsplice.client.model.kv_buffer_pool import KVBufferPool
from kvsplice.client.model.spare_slots_cache import SpareSlotsCache

NUM_LAYERS, NUM_HEADS, HEAD_DIM = 3, 2, 4
CPU = torch.device("cpu")


def _pool_cache(pool: KVBufferPool, num_tokens: int) -> SpareSlotsCache:
    return SpareSlotsCache(
        *pool.acquire(NUM_LAYERS, NUM_HEADS, num_tokens, HEAD_DIM, torch.float32, CPU)
    )


def _kv(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (1, NUM_HEADS, num_tokens, HEAD_DIM)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


@pytest.mark.parametrize("steps", [(5, 1, 1), (200, 300, 7), (1,) * 40])
def test_updates_hold_what_a_dynamic_cache_holds(steps: tuple[int, ...]) -> None:
    """Also past the capacity (the layer moves to a larger buffer)."""
    pool = KVBufferPool(spare_tokens=2, bucket_tokens=8)
    cache, dense = _pool_cache(pool, steps[0]), DynamicCache()
    for step, num_tokens in enumerate(steps):
        for layer in range(NUM_LAYERS):
            keys, values = _kv(num_tokens, seed=step * NUM_LAYERS + layer)
            got = cache.update(keys, values, layer)
            expected = dense.update(keys, values, layer)
            assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert cache.get_seq_length() == dense.get_seq_length() == sum(steps)


def test_in_place_slots_then_a_forward_update() -> None:
    cache = _pool_cache(KVBufferPool(), 6)
    keys, values = _kv(5, seed=0)

    def write(keys_out: torch.Tensor, values_out: torch.Tensor) -> None:  # [L, H, 5, D]
        keys_out.copy_(keys[0].expand(NUM_LAYERS, -1, -1, -1))
        values_out.copy_(values[0].expand(NUM_LAYERS, -1, -1, -1))

    cache.append_in_place(5, write)
    new_keys, new_values = _kv(1, seed=1)
    held_keys, held_values = cache.update(new_keys, new_values, 1)
    assert torch.equal(held_keys, torch.cat([keys, new_keys], dim=-2))
    assert torch.equal(held_values, torch.cat([values, new_values], dim=-2))
    assert cache.layers[1].in_buffer()  # extended in place, not concatenated


def test_append_in_place_refuses_layers_that_left_their_buffers() -> None:
    cache = _pool_cache(KVBufferPool(), 4)
    cache.layers[0].keys = torch.zeros(1, NUM_HEADS, 0, HEAD_DIM)  # replaced, as beam ops do
    with pytest.raises(ValueError, match="no longer hold"):
        cache.append_in_place(2, lambda keys, values: None)


def test_a_buffer_is_handed_out_again_only_when_nothing_holds_it() -> None:
    pool = KVBufferPool(max_buffers=2)
    cache = _pool_cache(pool, 10)
    view = cache.layers[0].keys
    del cache
    _pool_cache(pool, 10)  # the first pair is still seen through `view`
    assert pool.num_allocated == 2
    del view
    _pool_cache(pool, 12)  # the same bucket: a pair nothing holds
    _pool_cache(pool, 12)
    assert pool.num_allocated == 2


def test_the_pool_keeps_at_most_max_buffers() -> None:
    pool = KVBufferPool(max_buffers=1, bucket_tokens=8)
    _pool_cache(pool, 1), _pool_cache(pool, 100)  # the second evicts the first
    _pool_cache(pool, 1)
    assert pool.num_allocated == 3
    no_pool = KVBufferPool(max_buffers=0)
    _pool_cache(no_pool, 1), _pool_cache(no_pool, 1)
    assert no_pool.num_allocated == 2


def test_bad_pool_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="bucket_tokens 0"):
        KVBufferPool(bucket_tokens=0)
