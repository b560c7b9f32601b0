"""Exact RoPE reindexing of cached keys: `RopeSpec` (per-layer tables, layout, shift).

Owns the Δ-rotation k' = R(Δ)·k of post-RoPE keys and forward rotation of pre-RoPE
states; frequencies come from `kvmath.rope_tables`. It does not touch model caches
and never imports transformers: configs are read duck-typed.

Sign convention: Δ = new_position − old_position; a positive Δ moves a key later.
Angles Δ·inv_freq are formed in float64 and only cos/sin are cast to the compute
dtype (fp32, or fp64 for fp64 keys; fp16/bf16 keys are rotated in fp32 and cast
back once). Positions and deltas are never held in half precision.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvsplice.common.errors import UnsupportedRope
from kvsplice.kvmath.rope_tables import (
    RopeTable,
    default_inv_freq,
    rope_params_by_layer_type,
    table_from_rope_params,
)

__all__ = ["Delta", "Layout", "RopeSpec", "UnsupportedRope"]

logger = logging.getLogger(__name__)

Layout = Literal["rotate_half", "interleaved"]
Delta = int | torch.Tensor

# HF model types whose attention pairs channels (2i, 2i+1) (GPT-J style). Everything
# else in transformers pairs (i, i + rotary_dim/2) ("rotate_half", Llama/NeoX style).
INTERLEAVED_MODEL_TYPES = frozenset(
    {"glm", "glm4", "cohere", "cohere2", "helium", "ernie4_5", "ernie4_5_moe", "gptj"}
)
_OPERANDS_CACHE_SIZE = 64


@dataclass(frozen=True)
class RopeSpec:
    """How a model rotates keys, per layer: `tables[layer_tables[l]]` serves layer l.

    layout "rotate_half" pairs channel i with i + rotary_dim/2; "interleaved" pairs
    2i with 2i+1. Channels at or past rotary_dim pass through bit-identical.
    """

    head_dim: int
    layout: Layout
    tables: tuple[RopeTable, ...]
    layer_tables: tuple[int, ...]
    _cache: _OperandCache = field(init=False, compare=False, repr=False)
    _inv_freqs: tuple[torch.Tensor, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.layout not in ("rotate_half", "interleaved"):
            raise ValueError(f"layout {self.layout!r} must be 'rotate_half' or 'interleaved'")
        if not self.layer_tables or not all(0 <= t < len(self.tables) for t in self.layer_tables):
            raise ValueError(
                f"layer_tables {self.layer_tables} must index {len(self.tables)} tables"
            )
        for table in self.tables:
            if table.rotary_dim > self.head_dim:
                raise ValueError(f"rotary_dim {table.rotary_dim} > head_dim {self.head_dim}")
        object.__setattr__(self, "_cache", _OperandCache(_OPERANDS_CACHE_SIZE))
        object.__setattr__(self, "_inv_freqs", tuple(t.inv_freq_tensor() for t in self.tables))

    @classmethod
    def uniform(
        cls,
        head_dim: int,
        theta: float,
        num_layers: int = 1,
        layout: Layout = "rotate_half",
        rotary_dim: int | None = None,
        inv_freq: Sequence[float] | torch.Tensor | None = None,
    ) -> RopeSpec:
        """One table for every layer: default RoPE at `theta`, or the given inv_freq."""
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if inv_freq is None:
            inv_freq = default_inv_freq(theta, rotary_dim)
        if isinstance(inv_freq, torch.Tensor):
            inv_freq = inv_freq.tolist()
        params = (("rope_theta", float(theta)),)
        table = RopeTable("default", rotary_dim, tuple(float(f) for f in inv_freq), params=params)
        return cls(head_dim, layout, (table,), (0,) * num_layers)

    @classmethod
    def from_hf_config(cls, config: Any, layout: Layout | None = None) -> RopeSpec:
        """Read a (duck-typed) HF PretrainedConfig: v5 `rope_parameters` or v4 fields.

        Raises UnsupportedRope where a Δ-shift is not exact (dynamic, longrope, ...).
        `layout` defaults from `config.model_type` (see INTERLEAVED_MODEL_TYPES).
        """
        head_dim = getattr(config, "head_dim", None)
        head_dim = int(head_dim or config.hidden_size // config.num_attention_heads)
        params_by_type, layer_type_names = rope_params_by_layer_type(
            config, int(config.num_hidden_layers)
        )
        max_pos = getattr(config, "max_position_embeddings", None)
        names = sorted(params_by_type)
        tables = tuple(table_from_rope_params(params_by_type[n], head_dim, max_pos) for n in names)
        if layout is None:
            interleaved = getattr(config, "model_type", "") in INTERLEAVED_MODEL_TYPES
            layout = "interleaved" if interleaved else "rotate_half"
        return cls(head_dim, layout, tables, tuple(names.index(n) for n in layer_type_names))

    @property
    def num_layers(self) -> int:
        return len(self.layer_tables)

    def table(self, layer_idx: int) -> RopeTable:
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx {layer_idx} outside [0, {self.num_layers})")
        return self.tables[self.layer_tables[layer_idx]]

    def rotary_dim(self, layer_idx: int) -> int:
        return self.table(layer_idx).rotary_dim

    def inv_freq(self, layer_idx: int) -> torch.Tensor:
        """Layer `layer_idx`'s inv_freq, float64 on the CPU [rotary_dim // 2], built once
        per spec and shared: read it, never write it."""
        return self._inv_freqs[self.layer_tables[layer_idx]]

    def attention_scaling(self, layer_idx: int) -> float:
        """HF keys = attention_scaling · rotate(pre-RoPE keys); ≠ 1 only for yarn."""
        return self.table(layer_idx).attention_scaling

    def to_dict(self) -> dict[str, Any]:
        """Canonical, JSON-able description (part of the model fingerprint)."""
        return {
            "layout": self.layout,
            "head_dim": self.head_dim,
            "num_layers": self.num_layers,
            "tables": [t.to_dict() for t in self.tables],
            "layer_tables": list(self.layer_tables),
        }

    def shift(self, k: torch.Tensor, delta: Delta, layer_idx: int = 0) -> torch.Tensor:
        """Move post-RoPE keys of layer `layer_idx` by Δ positions: returns R(Δ)·k.

        k: [..., T, head_dim] (e.g. [H_kv, T, D]; heads broadcast, GQA/MQA alike).
        delta: int, or an integer tensor [T] (one Δ per token); Δ = new − old.
        Returns a new tensor of k's dtype. Δ = 0 (an int, or an all-zero tensor) is
        a bit-exact copy.
        """
        return self.shift_layers(k.unsqueeze(0), delta, layer_start=layer_idx).squeeze(0)

    def rotate(self, x: torch.Tensor, positions: Delta, layer_idx: int = 0) -> torch.Tensor:
        """Apply RoPE to pre-RoPE states x [..., T, head_dim] at absolute positions [T].

        A pure rotation R(p)·x (a shift from position 0); HF's yarn keys are
        additionally multiplied by `attention_scaling(layer_idx)`.
        """
        return self.shift(x, positions, layer_idx)

    def shift_layers(self, k_all: torch.Tensor, delta: Delta, layer_start: int = 0) -> torch.Tensor:
        """Shift keys of layers layer_start .. layer_start + L − 1 by Δ; returns a new tensor.

        k_all: [L, ..., T, head_dim] (e.g. [L, H_kv, T, D]); delta as in `shift`.
        All layers with the same rotary_dim go through one kernel sequence, with
        per-layer cos/sin where their tables differ (Gemma3 local/global).
        """
        num_layers = int(k_all.shape[0])
        self._check_shapes(k_all, delta, layer_start, num_layers)
        if _is_zero(delta):
            return k_all.clone()
        runs = self._runs_of_equal_rotary_dim(layer_start, layer_start + num_layers)
        if len(runs) == 1:
            return self._shift_run(k_all, delta, layer_start, layer_start + num_layers)
        out = torch.empty_like(k_all)
        for start, stop in runs:
            rows = slice(start - layer_start, stop - layer_start)
            out[rows] = self._shift_run(k_all[rows], delta, start, stop)
        return out

    def _check_shapes(
        self, k_all: torch.Tensor, delta: Delta, layer_start: int, num_layers: int
    ) -> None:
        if k_all.dim() < 3 or k_all.shape[-1] != self.head_dim:
            raise ValueError(f"keys {tuple(k_all.shape)} must be [L, ..., T, D={self.head_dim}]")
        if layer_start < 0 or layer_start + num_layers > self.num_layers:
            raise ValueError(
                f"layers [{layer_start}, {layer_start + num_layers}) outside [0, {self.num_layers})"
            )
        if isinstance(delta, torch.Tensor):
            if delta.is_floating_point() or delta.is_complex():
                raise ValueError(f"delta must be an integer tensor, got {delta.dtype}")
            if delta.dim() != 1 or delta.shape[0] != k_all.shape[-2]:
                raise ValueError(f"delta {tuple(delta.shape)} must be [T={k_all.shape[-2]}]")

    def _runs_of_equal_rotary_dim(self, start: int, stop: int) -> list[tuple[int, int]]:
        runs: list[tuple[int, int]] = []
        for layer in range(start, stop):
            if runs and self.rotary_dim(layer) == self.rotary_dim(runs[-1][0]):
                runs[-1] = (runs[-1][0], layer + 1)
            else:
                runs.append((layer, layer + 1))
        return runs

    def _shift_run(self, k_run: torch.Tensor, delta: Delta, start: int, stop: int) -> torch.Tensor:
        # k_run: [L_run, ..., T, D]; every layer of the run has the same rotary_dim.
        rotary_dim = self.rotary_dim(start)
        compute_dtype = torch.float64 if k_run.dtype == torch.float64 else torch.float32
        operands = self._operands(self.layer_tables[start:stop], delta, compute_dtype, k_run.device)
        # operands: [n, T or 1, X] with n in {1, L_run}; align to [L_run, 1.., T or 1, X].
        lead = (operands[0].shape[0],) + (1,) * (k_run.dim() - 3)
        operands = tuple(op.view(lead + tuple(op.shape[1:])) for op in operands)
        # Contiguous rotary channels keep every kernel on long rows (strided rows of
        # rotary_dim < head_dim measured ~4x slower per byte on CPU).
        x = k_run[..., :rotary_dim].to(compute_dtype).contiguous()
        rotate = _rotate_half if self.layout == "rotate_half" else _rotate_interleaved
        rotated = rotate(x, *operands)
        if rotary_dim == self.head_dim:
            return rotated.to(k_run.dtype)
        # NOTE: pass-through channels are copied, never computed, so they stay
        # bit-identical (x·1 + y·0 would turn −0.0 into +0.0).
        out = k_run.clone()
        out[..., :rotary_dim] = rotated
        return out

    def _operands(
        self, layer_tables: Sequence[int], delta: Delta, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        """Layout-ready cos/sin of Δ·inv_freq per layer table, cached for int Δ.

        rotate_half: (cos ‖ cos, −sin ‖ sin), each [n, T or 1, rotary_dim].
        interleaved: (cos + i·sin,) complex, [n, T or 1, rotary_dim / 2].
        n = 1 when all layers share one table (broadcast), else one row per layer.
        """
        table_ids = tuple(layer_tables[:1] if len(set(layer_tables)) == 1 else layer_tables)
        if isinstance(delta, torch.Tensor):
            return self._build_operands(table_ids, delta, dtype, device)
        key = (table_ids, int(delta), dtype, device)
        operands = self._cache.get(key)
        if operands is None:
            operands = self._build_operands(table_ids, torch.tensor([int(delta)]), dtype, device)
            self._cache.put(key, operands)
        return operands

    def _build_operands(
        self, table_ids: tuple[int, ...], delta: torch.Tensor, dtype: torch.dtype, device: Any
    ) -> tuple[torch.Tensor, ...]:
        on = delta.device if delta.device.type in ("cpu", "cuda") else torch.device("cpu")
        inv_freq = torch.stack([self._inv_freqs[t].to(on) for t in table_ids])
        # [n, T, half] in float64: Δ·inv_freq carries only fp64 rounding for |Δ| ≤ 2^53.
        angles = delta.to(device=on, dtype=torch.float64)[None, :, None] * inv_freq[:, None, :]
        cos, sin = angles.cos(), angles.sin()
        if self.layout == "interleaved":
            return (torch.complex(cos, sin).to(device=device, dtype=_complex_of(dtype)),)
        cos2, sin2 = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
        return cos2.to(device=device, dtype=dtype), sin2.to(device=device, dtype=dtype)


def _rotate_half(x: torch.Tensor, cos2: torch.Tensor, signed_sin2: torch.Tensor) -> torch.Tensor:
    """R·x for pairs (i, i + half): [a, b] -> [a·c − b·s, b·c + a·s]. Returns a new tensor.

    x: [..., T, rotary_dim]; cos2 = cos ‖ cos and signed_sin2 = −sin ‖ sin broadcast to x.
    """
    # NOTE: full-width kernels only. Per-half kernels (rows of rotary_dim/2 with
    # stride head_dim) measured ~7x slower per byte on CPU; flip allocates the
    # output once ([b, a]) and the two in-place passes finish it.
    half = x.shape[-1] // 2
    out = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)
    out.mul_(signed_sin2)
    return out.addcmul_(x, cos2)


def _rotate_interleaved(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """R·x for pairs (2i, 2i + 1), as one complex multiply. Returns a new tensor.

    x: [..., T, rotary_dim] real; rotation: complex cos + i·sin broadcast to [..., T, half].
    """
    pairs = x.unflatten(-1, (x.shape[-1] // 2, 2))  # x is contiguous: (re, im) adjacent
    if pairs.storage_offset() % 2:  # view_as_complex also needs an even element offset
        pairs = pairs.clone()
    return torch.view_as_real(torch.view_as_complex(pairs) * rotation).flatten(-2)


def _complex_of(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype == torch.float64 else torch.complex64


def _is_zero(delta: Delta) -> bool:
    if isinstance(delta, torch.Tensor):
        return not bool(delta.any())
    return int(delta) == 0


class _OperandCache:
    """A small thread-safe LRU: (table ids, int Δ, dtype, device) -> rotation operands."""

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._entries: OrderedDict[Any, tuple[torch.Tensor, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __reduce__(self) -> tuple[type, tuple[int]]:
        return (_OperandCache, (self._max_entries,))  # a pickled spec starts with a cold cache

    def get(self, key: Any) -> tuple[torch.Tensor, ...] | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: Any, value: tuple[torch.Tensor, ...]) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self._max_entries:
                self._entries.popitem(last=False)
