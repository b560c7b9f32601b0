"""Fused decode: stored K/V -> dequantized, RoPE-shifted K/V written into the caller's buffers.

Owns the one way K/V reach a cache (`decode_into`, from a `payload.StoredKV` or from
tensors) and its fast path: for int8, dequantize and the
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

from kvsplice.kvmath import cpu_decode
from kvsplice.kvmath.payload import KVSource, StoredKV
from kvsplice.kvmath.quant import StoredTensor, dequantize, dtype_name
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)


def decode_into(
    source: KVSource,
    rope: RopeSpec,
    delta: int,
    keys_out: torch.Tensor,
    values_out: torch.Tensor,
    staging: PinnedStaging | None = None,
) -> None:
    """Write `source`'s keys moved by Δ = new − old position, and its values, into the outs.

    keys_out, values_out: [L, H_kv, T, D] of any strides, dtype and device (e.g. a token
    slice of a cache buffer). Stored int8 K/V take the fused path (one pass, see the
    module doc); stored float K/V are read in place (no decoded copy), and tensors are
    moved to the outs' device, shifted when Δ ≠ 0 (`RopeSpec.shift_layers`), and copied.
    Δ = 0 is bit-exact. `staging` (pinned) carries int8 bytes to a GPU.
    """
    if tuple(keys_out.shape) != source.kv_shape or tuple(values_out.shape) != source.kv_shape:
        raise ValueError(f"outs {tuple(keys_out.shape)} must be the source's {source.kv_shape}")
    if isinstance(source, SegmentKV):
        keys, values = source.keys.to(keys_out.device), source.values
    elif source.keys.kind != "int8":
        keys, values = _host_view(source.keys), _host_view(source.values)
        if delta:  # NOTE: shifted in float32 at least, as a decode to float32 would have been
            keys = keys.to(keys_out.device, torch.promote_types(keys.dtype, torch.float32))
    elif _compiled_path(source, keys_out, values_out):
        _decode_compiled(source, rope, delta, keys_out, values_out)
        return
    else:
        device = keys_out.device
        shift_dequantize_into(
            _on(source.keys, device, staging), rope, delta, source.layer_start, keys_out
        )
        _dequantize_into(_on(source.values, device, staging), values_out)
        return
    if delta:
        keys = rope.shift_layers(keys, delta, layer_start=source.layer_start)
    keys_out.copy_(keys)
    values_out.copy_(values)


# NOTE: on CPU the work goes in blocks of about 1 MiB of float32 per torch thread (layers,
# or a run of a layer's tokens): the int8 -> float32 cast lands in a scratch block that stays in cache, and each
# output block is written to memory once although it is updated in place three times.
# Whole-tensor kernels measured ~2.5x slower per byte here (mixed int8 x float32 kernels
# are not vectorized; every extra pass goes to memory). GPUs take each run whole.
CPU_BLOCK_ELEMENTS = 1 << 18


def shift_dequantize_into(
    quantized: tuple[torch.Tensor, torch.Tensor],
    rope: RopeSpec,
    delta: int,
    layer_start: int,
    out: torch.Tensor,
) -> None:
    """out = R(Δ)·(q · scale) for int8 keys q [L, H_kv, T, D] with per-channel scales
    [L, H_kv, 1, D], computed in float32 and rounded once to out's dtype.

    NOTE: with k = q·σ, each rotated channel is q_i·(σ_i·cos) + q_partner·(∓σ_partner·sin):
    the coefficients are [L, H_kv, 1, D] (tiny), so per block the int8 data is cast once
    and the output written once (then finished in place by two multiply-adds on the
    rotation pairs' halves) instead of a float copy of the keys, a flipped copy, two
    more passes and a copy into the cache (the former path, ~6-15% of memcpy).
    """
    q, scale = quantized
    scratch = torch.empty(0, device=out.device)
    for run in _coefficient_runs(rope, delta, layer_start, scale):
        for rows, tokens in _blocks(run.rows, q.shape, out.device):
            chunk, target = _block(q, rows, tokens), _block(out, rows, tokens)
            if scratch.numel() < chunk.numel():
                scratch = torch.empty(chunk.numel(), device=out.device)
            work = scratch[: chunk.numel()].view(chunk.shape).copy_(chunk)  # the one int8 cast
            result = target if out.dtype == torch.float32 else torch.empty_like(work)
            layers = slice(rows.start - run.rows.start, rows.stop - run.rows.start)
            torch.mul(work, run.diagonal[layers], out=result)
            for first, second, on_first, on_second in run.pairs:
                result[..., first].addcmul_(work[..., second], on_first[layers])
                result[..., second].addcmul_(work[..., first], on_second[layers])
            if result is not target:
                target.copy_(result)


def _compiled_path(stored: StoredKV, keys_out: torch.Tensor, values_out: torch.Tensor) -> bool:
    """The one-pass CPU kernels (`kvmath.cpu_decode`) apply: int8 K and V, float32 CPU outs."""
    return (
        cpu_decode.available()
        and stored.values.kind == "int8"
        and all(cpu_decode.writable_target(o, stored.kv_shape) for o in (keys_out, values_out))
    )


def _decode_compiled(
    stored: StoredKV, rope: RopeSpec, delta: int, keys_out: torch.Tensor, values_out: torch.Tensor
) -> None:
    assert stored.keys.scale is not None and stored.values.scale is not None
    diag, off, rotary_dims = _layer_coefficients(
        rope, delta, stored.layer_start, torch.from_numpy(_writable(stored.keys.scale))
    )
    threads = torch.get_num_threads()
    cpu_decode.shift_dequantize_keys(
        stored.keys.data, diag, off, rotary_dims, rope.layout == "interleaved",
        keys_out, threads,
    )  # fmt: skip
    cpu_decode.dequantize_values(stored.values.data, stored.values.scale, values_out, threads)


def _layer_coefficients(
    rope: RopeSpec, delta: int, layer_start: int, scale: torch.Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_coefficient_runs` flattened per layer for the compiled kernels: diag and off
    [L, H, D] (off holds each channel's partner term) and rotary_dim [L] (0: no shift)."""
    num_layers = int(scale.shape[0])
    diag = np.empty((num_layers, scale.shape[1], scale.shape[3]), dtype=np.float32)
    off = np.zeros_like(diag)
    rotary_dims = np.zeros(num_layers, dtype=np.int64)
    for run in _coefficient_runs(rope, delta, layer_start, scale):
        rows = run.rows
        diag[rows] = run.diagonal[:, :, 0].numpy()
        for first, second, on_first, on_second in run.pairs:
            off[rows][..., first] = on_first[:, :, 0].numpy()
            off[rows][..., second] = on_second[:, :, 0].numpy()
            rotary_dims[rows] = rope.rotary_dim(layer_start + rows.start)  # one per run
    return diag, off, rotary_dims


def _writable(array: np.ndarray) -> np.ndarray:
    return array if array.flags.writeable else array.copy()  # scales are tiny


def _block(x: torch.Tensor, rows: slice, tokens: slice | None) -> torch.Tensor:
    return x[rows] if tokens is None else x[rows, :, tokens]


class _Run:
    """Layers `rows` sharing one rotary_dim and table: σ·cos on `diagonal` [L_run, H_kv, 1, D],
    and per rotation pair the channel slices of its members with the partner terms
    [L_run, H_kv, 1, rotary_dim / 2] added to each."""

    def __init__(self, rows: slice, diagonal: torch.Tensor) -> None:
        self.rows = rows
        self.diagonal = diagonal
        self.pairs: list[tuple[slice, slice, torch.Tensor, torch.Tensor]] = []


def _coefficient_runs(
    rope: RopeSpec, delta: int, layer_start: int, scale: torch.Tensor
) -> list[_Run]:
    """The runs of layers [layer_start, +L) with their coefficients (angles in float64)."""
    num_layers = int(scale.shape[0])
    sigma = scale.to(torch.float32)
    if delta == 0:  # a bit-exact dequantize: q·σ
        return [_Run(slice(0, num_layers), sigma)]
    runs = []
    for start, stop in _runs(rope, layer_start, num_layers):
        rows = slice(start - layer_start, stop - layer_start)
        cos, sin = _cos_sin(rope, delta, start, scale.device)  # [1, 1, 1, half]
        first, second = _halves(rope.layout, rope.rotary_dim(start))
        run = _Run(rows, sigma[rows].clone())
        run.diagonal[..., first].mul_(cos)
        run.diagonal[..., second].mul_(cos)
        on_first = sigma[rows][..., second] * -sin  # out_first += q_second·(−σ_second·sin)
        on_second = sigma[rows][..., first] * sin  # out_second += q_first·(σ_first·sin)
        run.pairs.append((first, second, on_first, on_second))
        runs.append(run)
    return runs


def _blocks(
    rows: slice, shape: torch.Size, device: torch.device
) -> list[tuple[slice, slice | None]]:
    """(layers, tokens) blocks covering layers `rows` of a [L, H, T, D] tensor (None: all
    tokens): a few layers, or a run of one layer's tokens, of ~1 MiB per torch thread."""
    _, num_heads, num_tokens, head_dim = shape
    if device.type != "cpu":
        return [(rows, None)]
    per_layer = num_heads * num_tokens * head_dim
    block_elements = CPU_BLOCK_ELEMENTS * torch.get_num_threads()
    if per_layer <= block_elements:
        step = max(1, block_elements // per_layer)
        return [
            (slice(a, min(a + step, rows.stop)), None) for a in range(rows.start, rows.stop, step)
        ]
    tokens_per_block = max(1, block_elements // (num_heads * head_dim))
    return [
        (slice(layer, layer + 1), slice(t, min(t + tokens_per_block, num_tokens)))
        for layer in range(rows.start, rows.stop)
        for t in range(0, num_tokens, tokens_per_block)
    ]


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
    rope: RopeSpec, delta: int, layer: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    # Δ·inv_freq in float64 (positions are never held in half precision), applied in fp32.
    angles = float(delta) * rope.inv_freq(layer)
    cos, sin = angles.cos().to(torch.float32), angles.sin().to(torch.float32)
    return cos.view(1, 1, 1, -1).to(device), sin.view(1, 1, 1, -1).to(device)


def _halves(layout: str, rotary_dim: int) -> tuple[slice, slice]:
    """Channel slices of each rotation pair's two members (see `kvmath.rope`)."""
    half = rotary_dim // 2
    if layout == "rotate_half":
        return slice(0, half), slice(half, rotary_dim)
    return slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)


def _dequantize_into(quantized: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> None:
    """out = q · scale (per-token value scales), blockwise: cast in place, then scale in place."""
    q, scale = quantized
    for rows, tokens in _blocks(slice(0, int(q.shape[0])), q.shape, out.device):
        target, factor = _block(out, rows, tokens), _block(scale, rows, tokens)
        if out.dtype == torch.float32:
            target.copy_(_block(q, rows, tokens))
            target.mul_(factor)
        else:
            target.copy_(_block(q, rows, tokens).to(torch.float32).mul_(factor))


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


def stored_tensors(stored: StoredKV, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[L, H_kv, T, D]` of a verified payload in `dtype`, to be read (never written):
    views of its bytes (read-only ones too) when it holds `dtype`, else dequantized once."""
    if stored.keys.kind == dtype_name(dtype):
        return _host_view(stored.keys), _host_view(stored.values)
    return dequantize(stored.keys, dtype), dequantize(stored.values, dtype)


def _host_view(array: np.ndarray | StoredTensor) -> torch.Tensor:
    """A CPU tensor over `array`'s memory, read-only payload bytes included (a stored
    tensor's data, bfloat16 bits viewed as bfloat16).

    NOTE: torch warns on views of read-only memory because it could write through
    them; the fused path only ever reads these tensors.
    """
    if isinstance(array, StoredTensor):
        view = _host_view(array.data)
        return view.view(torch.bfloat16) if array.kind == "bfloat16" else view
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def _torch_dtype(array: np.ndarray) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
