"""RoPE frequency tables: inv_freq per rope type, and which layers use which table.

Owns the formulas of the supported rope types (default, linear, llama3, yarn),
re-derived from transformers 5.x `modeling_rope_utils` without importing it, and
the refusal of the others. It does not rotate tensors (see `kvmath.rope`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvsplice.common.errors import UnsupportedRope

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# NOTE: Δ-rotation of a cached key is exact only when the frequencies used at
# capture and at reuse are the same static table. `dynamic` NTK recomputes
# inv_freq from the current sequence length once it exceeds
# max_position_embeddings, so a key cached under one length was rotated with
# other frequencies than a dense prefill at the new length would use.
# `longrope` switches between short and long factors on max(position)+1 versus
# original_max_position_embeddings, so R(p) and R(p+Δ) may come from different
# tables. Neither shift is a function of Δ alone: refuse and let callers
# recompute densely.
_REFUSED_WHY = {
    "dynamic": "dynamic NTK recomputes inv_freq from the sequence length",
    "longrope": "longrope switches short/long factors at original_max_position_embeddings",
}


@dataclass(frozen=True)
class RopeTable:
    """The rotary frequencies one group of layers uses.

    inv_freq: rotary_dim // 2 angular frequencies (radians per position), the fp32
        values the model uses, held as Python floats. Channel pair i rotates by
        position · inv_freq[i].
    attention_scaling: the factor HF folds into cos and sin (yarn's mscale); a
        Δ-shift never applies it, it is recorded for the fingerprint and for
        callers that rebuild HF keys from pre-RoPE states.
    params: the source scalars (rope_theta, factor, ...) for the fingerprint.
    """

    rope_type: str
    rotary_dim: int
    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim {self.rotary_dim} must be a positive even number")
        if len(self.inv_freq) != self.rotary_dim // 2:
            raise ValueError(
                f"{len(self.inv_freq)} inv_freq values for rotary_dim {self.rotary_dim}"
            )
        if not all(math.isfinite(f) and f > 0 for f in self.inv_freq):
            raise ValueError(f"inv_freq must be finite and positive, got {self.inv_freq}")

    def inv_freq_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """inv_freq as a float64 tensor [rotary_dim // 2]."""
        return torch.tensor(self.inv_freq, dtype=torch.float64, device=device)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rope_type": self.rope_type,
            "rotary_dim": self.rotary_dim,
            "inv_freq": list(self.inv_freq),
            "attention_scaling": self.attention_scaling,
            "params": dict(self.params),
        }


# NOTE (precision decision): inv_freq is computed in fp32 with HF's operations in
# HF's order, so it equals the model's `inv_freq` buffer bit for bit (asserted in
# tests/client/test_rope_hf_models.py); it is then held as Python floats and every
# angle Δ·inv_freq is formed in fp64. R(Δ)R(p) then differs from HF's own R(p+Δ)
# only by HF's fp32 angle rounding (~|p·θ|·2^-24). Measured on a tiny Llama
# (θ=5e5, D=64, 64 tokens from p=0), max |shift(k_p, Δ) − k_(p+Δ)| / max|k|:
#   Δ=1000: 1.7e-5 | Δ=30000: 4.5e-4 | Δ=131000: 2.4e-3   (this choice)
#   Δ=1000: 3.6e-5 | Δ=30000: 1.1e-3 | Δ=131000: 5.5e-3   (inv_freq fully in fp64)
#   Δ=1000: 2.6e-5 | Δ=30000: 8.5e-4 | Δ=131000: 3.3e-3   (fp32 angles, as HF)
# A fully-fp64 inv_freq is off the model's frequencies by ~1 fp32 ulp, adding a
# systematic Δ·θ·2^-24 on top. From p=100000 all three agree (~2e-3 to 5e-3):
# HF's rounding of the source keys dominates.


def default_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    """θ^(-2i/rotary_dim) for i < rotary_dim/2, in fp32 as HF computes it. -> [rotary_dim//2]"""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (theta**exponents)


def linear_inv_freq(theta: float, rotary_dim: int, factor: float) -> torch.Tensor:
    """Position interpolation: every frequency divided by `factor`."""
    return default_inv_freq(theta, rotary_dim) / factor


def llama3_inv_freq(
    theta: float,
    rotary_dim: int,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max: int,
) -> torch.Tensor:
    """Llama 3.1 smoothing: long wavelengths ÷ factor, short kept, a linear blend between."""
    base = default_inv_freq(theta, rotary_dim)
    wavelen = 2 * math.pi / base
    is_long = wavelen > original_max / low_freq_factor
    is_short = wavelen < original_max / high_freq_factor
    scaled = torch.where(is_long, base / factor, base)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~is_short & ~is_long, blended, scaled)


def yarn_attention_scaling(factor: float, params: Mapping[str, Any]) -> float:
    """YaRN's mscale (HF multiplies both cos and sin by it); never part of a shift."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(mscale_of(factor, mscale) / mscale_of(factor, mscale_all_dim))
    return mscale_of(factor)


def yarn_inv_freq(
    theta: float,
    rotary_dim: int,
    factor: float,
    original_max: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    truncate: bool = True,
) -> torch.Tensor:
    """YaRN (NTK-by-parts): extrapolate fast dims, interpolate slow ones, ramp between."""

    def dim_for_rotations(num_rotations: float) -> float:
        # The channel index whose wavelength fits `num_rotations` times in original_max.
        turns = original_max / (num_rotations * 2 * math.pi)
        return rotary_dim * math.log(turns) / (2 * math.log(theta))

    low, high = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    ramp = torch.clamp(
        (torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1
    )
    # Kept in HF's operation order (1 - ramp, then 1 - that) so fp32 values match bit for bit.
    extrapolation_weight = 1 - ramp
    interpolated = 1.0 / (factor * pos_freqs)
    extrapolated = 1.0 / pos_freqs
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def table_from_rope_params(
    params: Mapping[str, Any], head_dim: int, max_position_embeddings: int | None = None
) -> RopeTable:
    """Build the table for one HF v5 `rope_parameters` dict (flat, one layer type).

    Raises UnsupportedRope for dynamic, longrope, mRoPE and unknown rope types.
    """
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    for refused, why in _REFUSED_WHY.items():
        if refused in rope_type:
            raise UnsupportedRope(f"rope_type {rope_type!r}: {why}; a Δ-shift is not exact")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedRope(f"rope_type {rope_type!r} is not one of {SUPPORTED_ROPE_TYPES}")
    if params.get("mrope_section"):
        raise UnsupportedRope(
            "multimodal RoPE (mrope_section) positions are not a scalar per token"
        )
    theta = float(params["rope_theta"])
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
    if rotary_dim <= 0 or rotary_dim % 2:
        raise UnsupportedRope(
            f"rotary_dim {rotary_dim} (head_dim {head_dim}) must be positive and even"
        )
    inv_freq, scaling = _inv_freq_for_type(
        rope_type, theta, rotary_dim, params, max_position_embeddings
    )
    source = tuple(
        sorted((k, v) for k, v in params.items() if isinstance(v, (int, float, str, bool)))
    )
    return RopeTable(rope_type, rotary_dim, tuple(inv_freq.tolist()), scaling, source)


def _inv_freq_for_type(
    rope_type: str,
    theta: float,
    rotary_dim: int,
    params: Mapping[str, Any],
    max_position_embeddings: int | None,
) -> tuple[torch.Tensor, float]:
    if rope_type == "default":
        return default_inv_freq(theta, rotary_dim), 1.0
    if rope_type == "linear":
        return linear_inv_freq(theta, rotary_dim, float(params["factor"])), 1.0
    original_max = int(
        params.get("original_max_position_embeddings") or max_position_embeddings or 0
    )
    if original_max <= 0:
        raise UnsupportedRope(f"rope_type {rope_type!r} needs original_max_position_embeddings")
    if rope_type == "llama3":
        inv_freq = llama3_inv_freq(
            theta,
            rotary_dim,
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            original_max,
        )
        return inv_freq, 1.0
    factor = params.get("factor")
    if factor is None:  # DeepSeek-style configs give the ratio implicitly
        factor = (max_position_embeddings or original_max) / original_max
    inv_freq = yarn_inv_freq(
        theta,
        rotary_dim,
        float(factor),
        original_max,
        float(params.get("beta_fast") or 32),
        float(params.get("beta_slow") or 1),
        bool(params.get("truncate", True)),
    )
    return inv_freq, yarn_attention_scaling(float(factor), params)


def rope_params_by_layer_type(
    config: Any, num_layers: int
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """{name: flat rope params} and each layer's name, from a duck-typed HF config.

    Reads v5 `rope_parameters` (flat, or nested by `layer_types` as Gemma3 does) or
    v4 fields (`rope_theta`, `rope_scaling`, Gemma3's `rope_local_base_freq`).
    """
    layer_types = list(getattr(config, "layer_types", None) or [])
    params = getattr(config, "rope_parameters", None)
    if params is None:  # transformers 4.x: rope_theta + rope_scaling attributes
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    nested = [key for key in params if key in layer_types]
    if nested:
        missing = [name for name in set(layer_types) if params.get(name) is None]
        if missing:
            raise UnsupportedRope(f"no RoPE parameters for layer types {missing}")
        by_type = {name: _with_partial(config, params[name]) for name in set(layer_types)}
        return by_type, layer_types[:num_layers]
    flat = _with_partial(config, params)
    local_theta = getattr(config, "rope_local_base_freq", None)
    if local_theta is not None and "sliding_attention" in layer_types:  # Gemma3 on transformers 4.x
        local = _with_partial(config, {"rope_type": "default", "rope_theta": local_theta})
        return {"sliding_attention": local, "full_attention": flat}, layer_types[:num_layers]
    return {"all": flat}, ["all"] * num_layers


def _with_partial(config: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(params)
    if merged.get("partial_rotary_factor") is None:
        factor = getattr(config, "partial_rotary_factor", None) or getattr(
            config, "rotary_pct", None
        )
        merged["partial_rotary_factor"] = float(factor or 1.0)
    return merged
