"""Fake K/V for tests that need a `SegmentKV` of some shape and do not care what it holds."""

from __future__ import annotations

import torch

from kvsplice.kvmath.segment_kv import SegmentKV


def random_segment(
    num_layers: int,
    num_tokens: int,
    start: int = 0,
    *,
    num_heads: int = 2,
    head_dim: int = 16,
    seed: int | None = None,
) -> SegmentKV:
    """Standard-normal fp32 keys then values [L, H, T, D] at `start` (`seed`: a generator of
    its own; None: torch's global one)."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    shape = (num_layers, num_heads, num_tokens, head_dim)
    keys = torch.randn(shape, generator=generator)
    values = torch.randn(shape, generator=generator)
    return SegmentKV(keys, values, start_position=start)
