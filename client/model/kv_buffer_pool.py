"""K/V buffers a call's cache is built in, kept and handed out again across calls.

Owns `KVBufferPool`: one [L, 1, H_kv, T_cap, D] K and V pair per call, its capacity rounded
up to a bucket with spare slots for the tokens the call adds. It knows nothing about caches
or models. NOTE: a buffer is handed out again only when its storage is referenced by the
pool's own tensor alone; every view of it (a cache layer's keys, a slice a caller kept)
holds the storage, so memory anything still reads is never written by a later call. Fresh
buffers cost a page fault per 4 KiB on first touch (large allocations are mmapped and
returned to the kernel when freed): ~12k per 1,024-token SmolLM2 K/V pair per call.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

BufferKey = tuple[tuple[int, ...], torch.dtype, torch.device]


@dataclass(frozen=True, eq=False)
class _Pair:
    keys: torch.Tensor  # [L, 1, H_kv, T_cap, D]
    values: torch.Tensor
    bases: tuple[int | None, int | None]  # each storage's use count when only the pool held it

    def is_free(self) -> bool:
        counts = (storage_use_count(self.keys), storage_use_count(self.values))
        return counts == self.bases and None not in counts

    def handed_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Aliases of the buffers: while the caller holds them, the pair is not free."""
        return self.keys.view(self.keys.shape), self.values.view(self.values.shape)


class KVBufferPool:
    """Up to `max_buffers` K/V pairs, most recently used kept; thread-safe. One (the
    default) serves calls one after another: a call's cache is gone when the next begins.

    A pair's token capacity is `num_tokens + spare_tokens` rounded up to `bucket_tokens`,
    so calls of nearby lengths share one pair.
    """

    def __init__(self, max_buffers: int = 1, spare_tokens: int = 64, bucket_tokens: int = 256):
        if max_buffers < 0 or spare_tokens < 0 or bucket_tokens < 1:
            raise ValueError(
                f"max_buffers {max_buffers}, spare_tokens {spare_tokens} must be >= 0 and "
                f"bucket_tokens {bucket_tokens} >= 1"
            )
        self.max_buffers = max_buffers
        self.spare_tokens = spare_tokens
        self.bucket_tokens = bucket_tokens
        self.num_allocated = 0  # pairs allocated so far (a reuse allocates none)
        self._pairs: OrderedDict[int, tuple[BufferKey, _Pair]] = OrderedDict()
        self._lock = threading.Lock()

    def capacity(self, num_tokens: int) -> int:
        """Token slots of the pair `acquire(.., num_tokens, ..)` hands out."""
        wanted = num_tokens + self.spare_tokens
        return -(-wanted // self.bucket_tokens) * self.bucket_tokens

    def acquire(
        self,
        num_layers: int,
        num_kv_heads: int,
        num_tokens: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers [L, 1, H_kv, capacity(num_tokens), D] that nothing else holds.

        Their contents are undefined (a former call's K/V): the caller writes every slot it
        reads. The pool keeps a reference, and hands them out again once the caller's views
        are all gone.
        """
        shape = (num_layers, 1, num_kv_heads, self.capacity(num_tokens), head_dim)
        key: BufferKey = (shape, dtype, torch.device(device))
        with self._lock:
            for pair_id, (pair_key, pair) in self._pairs.items():
                if pair_key == key and pair.is_free():
                    self._pairs.move_to_end(pair_id)
                    return pair.handed_out()
            pair = self._allocate(shape, dtype, key[2])
            if self.max_buffers:
                self._pairs[id(pair)] = (key, pair)
            while len(self._pairs) > self.max_buffers:
                self._pairs.popitem(last=False)  # forgotten; freed when its users let go
            return pair.handed_out()

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> _Pair:
        keys = torch.empty(shape, dtype=dtype, device=device)
        values = torch.empty_like(keys)
        self.num_allocated += 1
        logger.debug(
            "K/V buffer pair %s %s allocated (%d so far)", shape, dtype, self.num_allocated
        )
        return _Pair(keys, values, (storage_use_count(keys), storage_use_count(values)))


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def storage_use_count(tensor: torch.Tensor) -> int | None:
    """How many tensors (and storage objects) reference `tensor`'s storage; None where this
    torch cannot tell (then no pair is ever handed out twice)."""
    if _USE_COUNT is None:
        return None
    return int(_USE_COUNT(tensor.untyped_storage()._cdata))
