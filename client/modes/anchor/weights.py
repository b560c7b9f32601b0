"""Anchor weights from base-cache distances: RMS distance, normalization, softmax(−d/τ).

Owns the pure tensor math shared by the correction and the gate. It knows
nothing about segments, agents or pools; callers hand it features.

Why normalized: KVCOMM takes softmax(−‖ΔV‖₂) over raw L2 norms of whole
multi-layer caches with τ = 1, which is one-hot in practice (its bug 5): the
gate's entropy is then ~0 and the weights are nearest-neighbour. Here a
distance is an RMS (L2 divided by √#elements, so it does not grow with T, L
or H) and is then divided by a scale, so τ is dimensionless:
- "median" (default): the median distance over the anchors (per token for
  per-token weights). Scale-free, so τ = 0.1 means an anchor 10% of the median
  distance closer gets e× the weight; equally distant anchors get equal weight.
- "query_rms": the RMS of the query's own features (a relative distance).
An anchor whose distance is ≤ `exact_rtol`·RMS(query) is an exact match (the
same tokens prefilled alone give the same base K/V up to fp noise); exact
matches share all the weight, because their offset is exactly right.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

logger = logging.getLogger(__name__)

Normalization = Literal["median", "query_rms"]
NORMALIZATIONS: tuple[Normalization, ...] = ("median", "query_rms")


@dataclass(frozen=True)
class WeightConfig:
    """tau: softmax temperature on normalized distances; see the module docstring."""

    tau: float = 0.1
    normalize: Normalization = "median"
    exact_rtol: float = 1e-5

    def __post_init__(self) -> None:
        if not self.tau > 0:
            raise ValueError(f"tau {self.tau} must be > 0")
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize {self.normalize!r} is not one of {NORMALIZATIONS}")
        if self.exact_rtol < 0:
            raise ValueError(f"exact_rtol {self.exact_rtol} must be >= 0")


def token_distances(query: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """query [T, F], anchors [A, T, F] -> [A, T]: per token, RMS over features of the difference."""
    return (anchors - query.unsqueeze(0)).square().mean(dim=-1).sqrt()


def whole_distances(query: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """query [T, F], anchors [A, T, F] -> [A]: RMS over all tokens and features of the difference."""
    return (anchors - query.unsqueeze(0)).square().flatten(1).mean(dim=1).sqrt()


def rms(x: torch.Tensor) -> float:
    """The root mean square of every element of x (0.0 for an empty tensor)."""
    return float(x.float().square().mean().sqrt()) if x.numel() else 0.0


def anchor_weights(
    distances: torch.Tensor, query_scale: float, config: WeightConfig
) -> torch.Tensor:
    """distances [A, ...] >= 0 -> weights [A, ...] summing to 1 over dim 0.

    query_scale: RMS of the query's features (the exact-match tolerance and the
    "query_rms" scale). Columns with an exact match split the weight equally
    among their exact anchors; the others get softmax(−normalized d / τ).
    """
    if distances.shape[0] == 0:
        raise ValueError("weights need at least one anchor")
    distances = distances.double()
    soft = torch.softmax(-normalized(distances, query_scale, config) / config.tau, dim=0)
    exact = distances <= config.exact_rtol * query_scale
    has_exact = exact.any(dim=0, keepdim=True)
    split = exact.double() / exact.sum(dim=0, keepdim=True).clamp(min=1)
    return torch.where(has_exact, split, soft).float()


def normalized(distances: torch.Tensor, query_scale: float, config: WeightConfig) -> torch.Tensor:
    """distances [A, ...] divided by the configured scale (a zero scale leaves them as is)."""
    if config.normalize == "query_rms":
        return distances / query_scale if query_scale > 0 else distances
    median = torch.quantile(distances, 0.5, dim=0, keepdim=True)
    return distances / torch.where(median > 0, median, torch.ones_like(median))
