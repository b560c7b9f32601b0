"""Fused decode: stored K/V -> dequantized, RoPE-shifted K/V written into the caller's buffers.

Owns the fast path from `payload.StoredKV` to a cache: for int8, dequantize and the
shift by Δ are one multiply pass plus one multiply-add per half of the rotary channels,
with the per-channel key scales folded into the cos/sin coefficients, writing straight
into the destination (a cache's preallocated buffer): no float copy of the keys, no
second copy into the cache. Device-agnostic torch: on CUDA the int8 bytes cross once
through a pinned staging buffer (non-blocking). Math conventions are `kvmath.rope`'s.
"""

from __future__ import annotations

import logging
import threading
import warnings

import numpy as np
import torch

from kvsplice.kvmath.payload import StoredKV
from kvsplice.kvmath.quant import StoredTensor, dequantize
from kvsplice.kvmath.rope import RopeSpec

logger = logging.getLogger(__name__)


def decode_into(
    stored: StoredKV,
    rope: RopeSpec,
    delta: int,
    keys_out: torch.Tensor,
    values_out: torch.Tensor,
    staging: PinnedStaging | None = None,
) -> None:
    """Write `stored`'s keys moved by Δ = new − old position, and its values, into the outs.

    keys_out, values_out: [L, H_kv, T, D] of any strides, dtype and device (e.g. a token
    slice of a cache buffer). int8 keys take the fused path (`shift_dequantize_into`);
    other kinds are decoded, shifted (`RopeSpec.shift_layers`) and copied once.
    """
    if keys_out.shape != stored.kv_shape or values_out.shape != stored.kv_shape:
        raise ValueError(f"outs {tuple(keys_out.shape)} must be the stored {stored.kv_shape}")
    if stored.keys.kind != "int8":
        _decode_then_copy(stored, rope, delta, keys_out, values_out)
        return
    device = keys_out.device
    shift_dequantize_into(
        _on(stored.keys, device, staging), rope, delta, stored.layer_start, keys_out
    )
    _dequantize_into(_on(stored.values, device, staging), values_out)


def shift_dequantize_into(
    quantized: tuple[torch.Tensor, torch.Tensor],
    rope: RopeSpec,
    delta: int,
    layer_start: int,
    out: torch.Tensor,
) -> None:
    """out = R(Δ)·(q · scale) for int8 keys q [L, H_kv, T, D] with per-channel scales
    [L, H_kv, 1, D], in three passes over `out` (computed in float32, rounded once).

    NOTE: with k = q·σ, each rotated channel is q_i·(σ_i·cos) + q_partner·(±σ_partner·sin):
    the coefficients are [L, H_kv, 1, D] (tiny), so the int8 data is read twice and the
    output written once plus updated in place twice, instead of a float copy of the keys,
    a flipped copy and two more passes (the former path: ~6% of memcpy, see bench core).
    """
    q, scale = quantized
    work = out if out.dtype == torch.float32 else torch.empty(out.shape, device=out.device)
    coefficients = _coefficients(rope, delta, layer_start, scale)
    torch.mul(q, coefficients.diagonal, out=work)
    for first, second, on_first, on_second in coefficients.pairs:
        work[first].addcmul_(q[second], on_first)
        work[second].addcmul_(q[first], on_second)
    if work is not out:
        out.copy_(work)


Index = tuple[slice, type(Ellipsis), slice]


class _Coefficients:
    """diagonal [L, H_kv, 1, D]; per run of layers, the (layers, ..., channels) index of
    each pair member and the partner term added to it ([L_run, H_kv, 1, rotary_dim / 2])."""

    def __init__(self, diagonal: torch.Tensor) -> None:
        self.diagonal = diagonal
        self.pairs: list[tuple[Index, Index, torch.Tensor, torch.Tensor]] = []


def _coefficients(
    rope: RopeSpec, delta: int, layer_start: int, scale: torch.Tensor
) -> _Coefficients:
    """σ·cos on the diagonal, ∓σ_partner·sin for the partners (angles in float64)."""
    num_layers = int(scale.shape[0])
    coefficients = _Coefficients(scale.to(torch.float32).clone())
    if delta == 0:
        return coefficients  # a bit-exact dequantize: q·σ
    for start, stop in _runs(rope, layer_start, num_layers):
        rows = slice(start - layer_start, stop - layer_start)
        cos, sin = _cos_sin(rope, delta, start, stop, scale.device)  # [n, 1, 1, half]
        first, second = _halves(rope.layout, rope.rotary_dim(start))
        sigma = scale[rows].to(torch.float32)
        coefficients.diagonal[rows][..., first].mul_(cos)
        coefficients.diagonal[rows][..., second].mul_(cos)
        on_first = sigma[..., second] * -sin  # out_first += q_second·(−σ_second·sin)
        on_second = sigma[..., first] * sin  # out_second += q_first·(σ_first·sin)
        coefficients.pairs.append(
            ((rows, Ellipsis, first), (rows, Ellipsis, second), on_first, on_second)
        )
    return coefficients


def _runs(rope: RopeSpec, layer_start: int, num_layers: int) -> list[tuple[int, int]]:
    """Layers [start, stop) sharing one rotary_dim and one table."""
    runs: list[tuple[int, int]] = []
    for layer in range(layer_start, layer_start + num_layers):
        key = (rope.rotary_dim(layer), rope.layer_tables[layer])
        if runs and key == (rope.rotary_dim(runs[-1][0]), rope.layer_tables[runs[-1][0]]):
            runs[-1] = (runs[-1][0], layer + 1)
        else:
            runs.append((layer, layer + 1))
    return runs


def _cos_sin(
    rope: RopeSpec, delta: int, start: int, stop: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    # Δ·inv_freq in float64 (positions are never held in half precision), applied in fp32.
    angles = float(delta) * rope.table(start).inv_freq_tensor()
    cos, sin = angles.cos().to(torch.float32), angles.sin().to(torch.float32)
    return cos.view(1, 1, 1, -1).to(device), sin.view(1, 1, 1, -1).to(device)


def _halves(layout: str, rotary_dim: int) -> tuple[slice, slice]:
    """Channel slices of each rotation pair's two members (see `kvmath.rope`)."""
    half = rotary_dim // 2
    if layout == "rotate_half":
        return slice(0, half), slice(half, rotary_dim)
    return slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)


def _dequantize_into(quantized: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
    """out = q · scale (per-token value scales), one pass."""
    q, scale = quantized
    if out.dtype == torch.float32:
        torch.mul(q, scale, out=out)
    else:
        out.copy_(q * scale)  # float32 product, rounded once to out's dtype


def _decode_then_copy(
    stored: StoredKV, rope: RopeSpec, delta: int, keys_out: torch.Tensor, values_out: torch.Tensor
) -> None:
    keys = dequantize(stored.keys, torch.float32).to(keys_out.device)
    if delta:
        keys = rope.shift_layers(keys, delta, layer_start=stored.layer_start)
    keys_out.copy_(keys)
    values_out.copy_(dequantize(stored.values, torch.float32))


class PinnedStaging:
    """One page-locked host buffer, grown on demand, for non-blocking host-to-GPU copies.

    Not shared between threads (a lock guards the buffer while a copy is queued).
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._lock = threading.Lock()

    def to_device(self, array: np.ndarray, device: torch.device) -> torch.Tensor:
        """`array` on `device`: staged into pinned memory, then copied asynchronously."""
        nbytes = array.nbytes
        with self._lock:
            if self._buffer is None or self._buffer.numel() < nbytes:
                self._buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            staged = self._buffer[:nbytes].view(_torch_dtype(array)).view(array.shape)
            staged.copy_(_host_view(array))
            moved = staged.to(device, non_blocking=True)
            # NOTE: the next staging must not overwrite bytes still in flight.
            torch.cuda.current_stream(device).synchronize()
        return moved


def _on(
    stored: StoredTensor, device: torch.device, staging: PinnedStaging | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of an int8 stored tensor as tensors on `device`."""
    assert stored.scale is not None
    if device.type == "cpu":
        return _host_view(stored.data), _host_view(stored.scale)
    staging = staging or PinnedStaging()
    return staging.to_device(stored.data, device), staging.to_device(stored.scale, device)


def _host_view(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor over `array`'s memory, read-only payload bytes included.

    NOTE: torch warns on views of read-only memory because it could write through
    them; the fused path only ever reads these tensors.
    """
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _torch_dtype(array: np.ndarray) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
