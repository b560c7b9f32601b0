"""KV layout: the shape facts a payload must agree with to be spliced."""

from __future__ import annotations

from dataclasses import dataclass

KV_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class KVLayout:
    """Per-model KV geometry. Tensors are `[num_kv_heads, T, head_dim]` per layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "hidden_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {KV_DTYPES}")
