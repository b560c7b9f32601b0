"""Explicit position-causal attention masks for the layerwise executor.

Owns the additive 4-D mask a decoder layer receives in place of the one
`create_causal_mask` would build. It knows nothing about models or plans.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def allowed_keys(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Which keys each query may attend to: [N, K] bool.

    query_positions: [N] long; key_positions: [K] long (absolute RoPE positions).
    A query at p sees a key at p' iff p' <= p and, for a sliding layer,
    p - p' < window (HF's `sliding_window_overlay`: kv_idx > q_idx - window).
    """
    diff = query_positions[:, None] - key_positions[None, :]
    allowed = diff >= 0
    if window is not None:
        allowed &= diff < window
    return allowed


def additive_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The mask eager and SDPA attention add to q·kᵀ: [1, 1, N, K] of 0 or finfo(dtype).min.

    The finite minimum (not -inf) follows HF's eager masks: a row is never all
    -inf, so softmax cannot produce NaN.
    """
    allowed = allowed_keys(query_positions, key_positions, window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
