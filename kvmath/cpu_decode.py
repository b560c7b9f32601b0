"""CPU kernels of the fused decode: int8 keys dequantized and RoPE-shifted, and int8
values dequantized, each in ONE pass over the bytes, compiled with numba.

Owns the loops `fused_decode` runs on CPU for a float32 destination. The math is
`fused_decode`'s (scales folded into the rotation coefficients):

    out[a] = q[a]·diag[a] + q[b]·off[a],   out[b] = q[b]·diag[b] + q[a]·off[b]

for each rotation pair (a, b) of the layer's rotary channels, and out[j] = q[j]·diag[j]
past them. Per element: one int8 load, two multiply-adds, one float32 store; the torch
path needs a cast pass, a multiply pass and two half-width multiply-add passes per
block (~4-5x slower per byte here, one thread).
Layers are split between `torch.get_num_threads()` threads (the kernels release the GIL).
Without numba (it is in the `worker` extra) `available()` is False and callers keep
the torch path.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

logger = logging.getLogger(__name__)


@functools.cache
def available() -> bool:
    """numba can be imported (checked once, without importing it: that costs ~0.4 s)."""
    return importlib.util.find_spec("numba") is not None


def shift_dequantize_keys(
    q: np.ndarray,
    diag: np.ndarray,
    off: np.ndarray,
    rotary_dims: np.ndarray,
    interleaved: bool,
    out: torch.Tensor,
    num_threads: int = 1,
) -> None:
    """out[l, h, t] = R(Δ)·(q[l, h, t]·σ[l, h]) with σ and R folded into diag/off.

    q int8 [L, H, T, D]; diag, off float32 [L, H, D]; rotary_dims int64 [L] (even, <= D;
    0: no rotation); out float32 CPU [L, H, T, D] with contiguous channels and any other
    strides (e.g. a token slice of a cache buffer).
    """
    keys = _kernels()[0]
    parent, first = _parent(out, q.shape)
    q, diag, off = (np.ascontiguousarray(a) for a in (q, diag, off))
    rotary_dims = np.ascontiguousarray(rotary_dims, dtype=np.int64)
    _over_layers(
        lambda lo, hi: keys(q, diag, off, rotary_dims, interleaved, parent, first, lo, hi),
        q.shape[0],
        num_threads,
    )


def dequantize_values(
    q: np.ndarray, scale: np.ndarray, out: torch.Tensor, num_threads: int = 1
) -> None:
    """out = q · scale for int8 q [L, H, T, D] with per-token float32 scales [L, H, T, 1];
    out as in `shift_dequantize_keys`."""
    values = _kernels()[1]
    parent, first = _parent(out, q.shape)
    q, scale = np.ascontiguousarray(q), np.ascontiguousarray(scale)
    _over_layers(lambda lo, hi: values(q, scale, parent, first, lo, hi), q.shape[0], num_threads)


def writable_target(out: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """The kernels can write `out`: float32 on CPU, `shape`, and a token range of a
    contiguous [L, H, T', D] block (a whole tensor, or a slice of a cache buffer)."""
    return (
        out.device.type == "cpu"
        and out.dtype == torch.float32
        and not out.requires_grad
        and tuple(out.shape) == tuple(shape)
        and _parent_geometry(out) is not None
    )


def _parent_geometry(out: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage offset of the block, its T', first token) or None."""
    num_layers, num_heads, num_tokens, head_dim = map(int, out.shape)
    s_layer, s_head, s_token, s_channel = out.stride()
    if s_channel != 1 or s_token != head_dim or s_head % head_dim:
        return None
    block_tokens = s_head // head_dim
    if s_layer != num_heads * s_head and num_layers > 1:
        return None
    offset = int(out.storage_offset())
    first = (offset % s_head) // head_dim if s_head else 0
    start = offset - first * head_dim
    size = num_layers * num_heads * block_tokens * head_dim
    if first + num_tokens > block_tokens or start + size > out.untyped_storage().nbytes() // 4:
        return None
    return start, block_tokens, first


def _parent(out: torch.Tensor, shape: tuple[int, ...]) -> tuple[np.ndarray, int]:
    """The contiguous [L, H, T', D] block `out` is a token range of, as numpy, and the
    range's first token.

    NOTE: numba vectorizes the channel loop only for rows of a contiguous ('C') array;
    indexing strided ('A') arrays, or a flat storage by computed offsets, measured
    2-15x slower here.
    """
    geometry = _parent_geometry(out) if tuple(out.shape) == tuple(shape) else None
    if geometry is None or out.dtype != torch.float32:
        raise ValueError(f"out {tuple(out.shape)} is not a float32 token range of a block")
    start, block_tokens, first = geometry
    num_layers, num_heads, _, head_dim = out.shape
    block = torch.as_strided(
        out, (num_layers, num_heads, block_tokens, head_dim),
        (num_heads * block_tokens * head_dim, block_tokens * head_dim, head_dim, 1), start,
    )  # fmt: skip
    return block.numpy(), first


def warm_up() -> None:
    """Compile (or load from numba's cache) both kernels now rather than on first use."""
    if available():
        _kernels()


def _over_layers(run: Callable[[int, int], None], num_layers: int, num_threads: int) -> None:
    """`run(lo, hi)` over layer ranges, split between up to `num_threads` threads."""
    parts = max(1, min(num_threads, num_layers))
    if parts == 1:
        run(0, num_layers)
        return
    bounds = [round(i * num_layers / parts) for i in range(parts + 1)]
    futures = [_pool(parts).submit(run, bounds[i], bounds[i + 1]) for i in range(1, parts)]
    run(bounds[0], bounds[1])  # this thread takes the first part
    for future in futures:
        future.result()


_POOL_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0


def _pool(parts: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or parts - 1 > _POOL_SIZE:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL = ThreadPoolExecutor(max_workers=parts - 1, thread_name_prefix="kvsplice-decode")
            _POOL_SIZE = parts - 1
        return _POOL


_COMPILE_LOCK = threading.Lock()
_COMPILED: tuple[Callable[..., None], Callable[..., None]] | None = None


def _kernels() -> tuple[Callable[..., None], Callable[..., None]]:
    """Both kernels, compiled on first use with one signature each (contiguous arrays;
    destinations are passed as their contiguous block, see `_parent`); numba's on-disk
    cache makes later processes load them in a fraction of a second."""
    global _COMPILED
    with _COMPILE_LOCK:
        if _COMPILED is None:
            try:
                _COMPILED = _compile(cache=True)
            except RuntimeError as error:  # no writable cache location (read-only image)
                logger.warning("numba cannot cache the decode kernels (%s); compiling", error)
                _COMPILED = _compile(cache=False)
        return _COMPILED


def _compile(cache: bool) -> tuple[Callable[..., None], Callable[..., None]]:
    import numba

    int8_4d = numba.types.Array(numba.int8, 4, "C", readonly=True)
    f32_4d = numba.types.Array(numba.float32, 4, "C", readonly=True)
    f32_3d = numba.types.Array(numba.float32, 3, "C", readonly=True)
    i64_1d = numba.types.Array(numba.int64, 1, "C", readonly=True)
    out_4d = numba.types.Array(numba.float32, 4, "C")
    i64 = numba.int64
    keys_sig = numba.void(int8_4d, f32_3d, f32_3d, i64_1d, numba.boolean, out_4d, i64, i64, i64)
    values_sig = numba.void(int8_4d, f32_4d, out_4d, i64, i64, i64)
    keys = numba.njit(keys_sig, nogil=True, cache=cache, fastmath={"contract"})(_keys_loop)
    values = numba.njit(values_sig, nogil=True, cache=cache, fastmath={"contract"})(_values_loop)
    return keys, values


def _keys_loop(q, diag, off, rotary_dims, interleaved, out, first_token, lo, hi):  # type: ignore[no-untyped-def]
    _, num_heads, num_tokens, head_dim = q.shape
    for layer in range(lo, hi):
        rotary = rotary_dims[layer]
        half = rotary // 2
        for head in range(num_heads):
            d = diag[layer, head]
            o = off[layer, head]
            for token in range(num_tokens):
                row = q[layer, head, token]
                dst = out[layer, head, first_token + token]
                if interleaved:
                    for i in range(half):
                        a = 2 * i
                        x = np.float32(row[a])
                        y = np.float32(row[a + 1])
                        dst[a] = x * d[a] + y * o[a]
                        dst[a + 1] = y * d[a + 1] + x * o[a + 1]
                else:
                    for a in range(half):
                        b = a + half
                        x = np.float32(row[a])
                        y = np.float32(row[b])
                        dst[a] = x * d[a] + y * o[a]
                        dst[b] = y * d[b] + x * o[b]
                # NOTE: a loop from a runtime start is not vectorized (10x slower);
                # one over slices from 0 is.
                tail_dst, tail_row, tail_d = dst[rotary:], row[rotary:], d[rotary:]
                for j in range(head_dim - rotary):
                    tail_dst[j] = np.float32(tail_row[j]) * tail_d[j]


def _values_loop(q, scale, out, first_token, lo, hi):  # type: ignore[no-untyped-def]
    _, num_heads, num_tokens, head_dim = q.shape
    for layer in range(lo, hi):
        for head in range(num_heads):
            for token in range(num_tokens):
                s = scale[layer, head, token, 0]
                row = q[layer, head, token]
                dst = out[layer, head, first_token + token]
                for j in range(head_dim):
                    dst[j] = np.float32(row[j]) * s
