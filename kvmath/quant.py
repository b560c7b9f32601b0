"""KV quantization: the stored numeric form of K, V and boundary states, and back.

Owns the schemes, their grouping and their error bounds; byte layout, headers
and checksums belong to `kvmath.payload`.

Schemes (`QUANT_SCHEMES`):
- "none": the captured dtype (float32, float16 or bfloat16), stored bit-exact.
- "fp16": one rounding to float16 on store, |x - x̂| <= max(2**-11 |x|, 2**-25);
  encode refuses inf, nan and values that overflow float16.
- "int8": symmetric, zero-point-free, KIVI-style grouping:
  keys per channel (one scale per (layer, kv-head, channel), reduced over the
  segment's T tokens, because keys have outlier channels) and values per token
  (one scale per (layer, kv-head, token), reduced over head_dim).
  scale = max(max|group|, SCALE_FLOOR) / 127 in float32, q = round(x / scale),
  x̂ = q * scale. Error bound, per element, for float32 output:
      |x - x̂| <= scale * (1/2 + 2**-16)      (≈ max|group| / 254)
  (1/2 from rounding to q; 2**-16 covers the float32 roundings of x/scale and
  q*scale, (128 + 127) * 2**-24 <= 2**-16, relative to the stored scale).
  A float16 or bfloat16
  output adds its own final rounding. Scales are float32: the bound then holds
  for any finite input (float16 scales would overflow above 65504 * 127 and
  lose relative precision below 6e-5 * 127), at 4 bytes per 64 values of V.

Boundary hidden states are never quantized (see `store_exact`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvsplice.kvmath import cpu_decode

logger = logging.getLogger(__name__)

QUANT_SCHEMES = ("none", "fp16", "int8")
KEY_GROUP_DIM = -2  # keys [..., T, D]: reduce over T -> one scale per channel
VALUE_GROUP_DIM = -1  # values [..., T, D]: reduce over D -> one scale per token
INT8_MAX = 127
# NOTE: the floor keeps scales normal floats: all-zero groups get q = 0 with no
# division by zero, and groups below ~1e-30 (never seen in KV) keep the bound.
SCALE_FLOOR = 2.0**-100
FP16_MAX = 65504.0
# NOTE: symmetric rather than asymmetric (min/max + zero point), after measuring
# relative RMSE: asymmetric is 6% better on gaussian keys with high-variance
# outlier channels, 2x with one-signed outlier channels, 11% on gaussian values,
# and 24% (K) / 16% (V) on SmolLM2-135M K/V of 512 tokens: ~0.3 bit. It would
# cost a third pass in dequantize (measured ~1.6x time on the reuse hot path),
# double V's scale bytes (6.25% -> 12.5%) and add a |zero point| term to the
# bound; symmetric also stores 0 exactly. Per-channel key grouping already
# isolates outlier channels, which is where most of the error went.

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# bfloat16 has no numpy dtype: its bits travel as int16 and are viewed back.
STORED_NUMPY_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
}
SCALE_NUMPY_DTYPE = np.dtype(np.float32)


@dataclass(frozen=True)
class StoredTensor:
    """A tensor in stored form; `data` and `scale` may be read-only views of payload bytes.

    data:  the tensor's shape, numpy dtype `STORED_NUMPY_DTYPES[kind]`.
    kind:  "float32" | "float16" | "bfloat16" | "int8".
    scale: int8 only; float32, same rank as `data` with size 1 on the group dim.
    """

    data: np.ndarray
    kind: str
    scale: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.kind not in STORED_NUMPY_DTYPES:
            raise ValueError(f"kind {self.kind!r} not in {tuple(STORED_NUMPY_DTYPES)}")
        if self.data.dtype != STORED_NUMPY_DTYPES[self.kind]:
            raise ValueError(f"data dtype {self.data.dtype} does not store kind {self.kind!r}")
        if (self.kind == "int8") != (self.scale is not None):
            raise ValueError(f"kind {self.kind!r} needs scale iff int8")


def dtype_name(dtype: torch.dtype) -> str:
    """ "float32" | "float16" | "bfloat16" for a supported KV dtype, else ValueError."""
    for name, candidate in TORCH_DTYPES.items():
        if candidate == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not a KV dtype {tuple(TORCH_DTYPES)}")


def check_quant(quant: str) -> str:
    """`quant` if it is one of `QUANT_SCHEMES`, else `ValueError` naming the choices."""
    if quant not in QUANT_SCHEMES:
        raise ValueError(f"quant {quant!r} not in {QUANT_SCHEMES}")
    return quant


def stored_kind(scheme: str, captured_dtype: str) -> str:
    """The stored element kind of K/V under `scheme` for a tensor captured in `captured_dtype`."""
    check_quant(scheme)
    if captured_dtype not in TORCH_DTYPES:
        raise ValueError(f"captured dtype {captured_dtype!r} not in {tuple(TORCH_DTYPES)}")
    return {"none": captured_dtype, "fp16": "float16", "int8": "int8"}[scheme]


def quantize_int8(x: torch.Tensor, group_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one float32 scale per group reduced over `group_dim`.

    x: any shape, float32/float16/bfloat16, finite, any device. Returns CPU (q, scale):
    q int8 of x's shape with |q| <= 127; scale float32, x's shape with size 1
    on `group_dim`. Raises ValueError on non-finite input.
    """
    # NOTE: computed on x's device; only the 4x smaller int8 result crosses to the CPU.
    # amax/amin run in x's own dtype (exact) and beat aminmax and abs().amax on CPU
    # (aminmax costs ~10 ms even on tiny inputs in torch 2.13); both propagate nan.
    x = x.detach()
    hi, lo = x.amax(dim=group_dim, keepdim=True), x.amin(dim=group_dim, keepdim=True)
    amax = torch.maximum(hi, lo.neg_()).float()
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("int8 quantization needs finite input; got inf or nan")
    scale = amax.clamp_(min=SCALE_FLOOR).div_(INT8_MAX)
    # NOTE: x / scale is computed in float32 by type promotion, without a float32
    # copy of x. No clamp needed: |fl(x / scale)| <= 127 * (1 + 2**-23) < 127.5.
    q = torch.div(x, scale).round_().to(torch.int8)
    return q.cpu(), scale.cpu()


def dequantize_int8(
    q: torch.Tensor | np.ndarray,
    scale: torch.Tensor | np.ndarray,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x̂ = q * scale in `dtype`, in two passes over the output (cast, then scale in place).

    q: int8, any shape (a read-only numpy view is fine: it is only read).
    scale: float32, broadcastable to q. Returns a new CPU tensor of q's shape.
    bfloat16 output is computed in float32 and rounded once (one extra pass).
    """
    if dtype == torch.float32 and cpu_decode.available():
        compiled = _dequantize_compiled(q, scale)
        if compiled is not None:
            return compiled
    # NOTE: copying read-only scales is cheap: they are <= 1/64 of the data.
    scale_t = _tensor_view(scale) if isinstance(scale, np.ndarray) else scale
    work_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    out = _cast_copy(q, work_dtype)
    # NOTE: mul_ by a float32 scale computes in float32 and rounds once to out's dtype.
    out.mul_(scale_t)
    return out if work_dtype == dtype else out.to(dtype)


def _dequantize_compiled(
    q: torch.Tensor | np.ndarray, scale: torch.Tensor | np.ndarray
) -> torch.Tensor | None:
    """q · scale in one pass (`kvmath.cpu_decode`) for stored K or V [L, H, T, D] with
    per-channel or per-token scales; None for any other shape (the torch path takes it).
    One float32 multiply per element, so the result is bit-identical to the torch path."""
    if not isinstance(q, np.ndarray) or not isinstance(scale, np.ndarray) or q.ndim != 4:
        return None
    if scale.dtype != np.float32:
        return None
    num_layers, num_heads, num_tokens, head_dim = q.shape
    out = torch.empty(q.shape, dtype=torch.float32)
    if scale.shape == (num_layers, num_heads, 1, head_dim):  # keys: one scale per channel
        cpu_decode.shift_dequantize_keys(
            q, scale[:, :, 0, :], np.zeros(scale[:, :, 0, :].shape, dtype=np.float32),
            np.zeros(num_layers, dtype=np.int64), False, out, torch.get_num_threads(),
        )  # fmt: skip
        return out
    if scale.shape == (num_layers, num_heads, num_tokens, 1):  # values: one per token
        cpu_decode.dequantize_values(q, scale, out, torch.get_num_threads())
        return out
    return None


def quantize(x: torch.Tensor, scheme: str, group_dim: int) -> StoredTensor:
    """The stored form of K or V `x` ([L, H_kv, T, D]) under `scheme`.

    group_dim: `KEY_GROUP_DIM` for keys, `VALUE_GROUP_DIM` for values (int8 only).
    The result owns fresh, contiguous CPU memory except for "none" on a
    contiguous CPU tensor, which views `x`.
    """
    kind = stored_kind(scheme, dtype_name(x.dtype))
    if kind == "int8":
        q, scale = quantize_int8(x, group_dim)
        return StoredTensor(q.numpy(), "int8", scale.numpy())
    if scheme == "fp16":
        return StoredTensor(_to_fp16(x).numpy(), "float16")
    return store_exact(x)


def dequantize(stored: StoredTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor of `stored` in `dtype`; shape of `stored.data`.

    Zero-copy (a view of the stored bytes) when `stored.kind` is `dtype` and the
    data is writable and aligned; otherwise one pass into new memory (two for
    conversions that involve bfloat16 from read-only data).
    """
    if stored.kind == "int8":
        assert stored.scale is not None  # guaranteed by StoredTensor.__post_init__
        return dequantize_int8(stored.data, stored.scale, dtype)
    if stored.kind == dtype_name(dtype):
        return _view_or_copy(stored)
    if stored.kind != "bfloat16" and dtype != torch.bfloat16:
        return _cast_copy(stored.data, dtype)
    return _view_or_copy(stored).to(dtype)


def store_exact(x: torch.Tensor) -> StoredTensor:
    """Bit-exact stored form of `x` (any shape) in its own dtype; views a contiguous CPU `x`.

    Boundary states [T, hidden] always take this path, whatever the scheme:
    they seed the recompute of every layer above a cut, and the residual
    stream's massive activations (|h| up to ~25000 in SmolLM2) swamp a
    per-token int8 scale: measured relative RMSE 1.7-5.2% by layer, against
    0.45-0.68% for int8 K/V. At [T, 576] per cut they are ~5% of its K/V bytes.
    """
    kind = dtype_name(x.dtype)
    xc = x.detach().to("cpu").contiguous()
    if kind == "bfloat16":
        xc = xc.view(torch.int16)
    return StoredTensor(xc.numpy(), kind)


def _to_fp16(x: torch.Tensor) -> torch.Tensor:
    """x cast to float16 on CPU; ValueError on inf/nan or |x| beyond float16's range."""
    xh = x.detach().to(dtype=torch.float16).cpu().contiguous()
    # NOTE: max and min propagate nan and see inf, and are ~10x cheaper than isfinite().all().
    if not bool(torch.isfinite(torch.stack([xh.max(), xh.min()])).all()):
        raise ValueError(f"fp16 storage needs finite values with |x| <= {FP16_MAX}")
    return xh


def _cast_copy(data: torch.Tensor | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor of `dtype` holding `data` converted (one pass; numpy-native dtypes)."""
    out = torch.empty(tuple(data.shape), dtype=dtype)
    if isinstance(data, np.ndarray):
        # NOTE: numpy reads read-only payload views without the copy or the
        # warning torch.from_numpy would need; float32/float16/int8 only.
        np.copyto(out.numpy(), data, casting="same_kind")
    else:
        out.copy_(data)
    return out


def _view_or_copy(stored: StoredTensor) -> torch.Tensor:
    """Torch tensor of `stored.data` in its own kind (a view if writable and aligned)."""
    tensor = _tensor_view(stored.data)
    return tensor.view(torch.bfloat16) if stored.kind == "bfloat16" else tensor


def _tensor_view(array: np.ndarray) -> torch.Tensor:
    """torch view of `array` if writable and aligned, else of a copy (torch cannot view read-only memory)."""
    safe = array.flags.writeable and array.flags.aligned
    return torch.from_numpy(array if safe else array.copy())
