"""KVComm's gate (seed 002): reuse a span with a correction, or compute it and store a new anchor.

`decide` owns the decision (length rule, then the entropy of the anchor weights in bits
against γ·log2|A|) and the ids whose use count to bump. It does not touch the pool
(`AnchorPool.touch`/`add` are the caller's) and computes no K/V.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch

from kvsplice.kvmath.anchors import (
    METRICS,
    Anchor,
    Metric,
    anchor_weights,
    base_features,
    eligible_anchors,
    rms,
    whole_distances,
)
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

# Default distance "value" (KVCOMM's code: the base V cache): values carry no
# RoPE, so no alignment can go wrong and anchors made at any position compare
# alike. "key" aligns anchor keys to the query's positions first; "hidden" uses
# stored boundary states. Distances are normalized (see the module docstring):
# KVCOMM's raw L2 with τ = 1 makes H ≈ 0, so its gate almost never fires.


GateReason = Literal["pool_too_small", "too_few_eligible", "ambiguous", "confident"]


@dataclass(frozen=True)
class GateDecision:
    """reuse False means: prefill densely and store this sample as a new anchor.

    anchor_ids/weights: the eligible anchors (pool order) and their whole-sample
    weights (empty before the entropy step); activated_ids: the anchors making
    up the top-p weight mass, to `touch` when reusing (empty when dense).
    """

    reuse: bool
    reason: GateReason
    anchor_ids: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()
    entropy_bits: float = 0.0
    threshold_bits: float = 0.0
    activated_ids: tuple[str, ...] = ()


def decide(
    query_base: SegmentKV,
    pool: Sequence[Anchor],
    rope: RopeSpec,
    agent_id: str | None = None,
    *,
    gamma: float = 0.3,
    metric: str = "value",
    tau: float = 0.1,
    top_p: float = 0.9,
    hidden_layer: int | None = None,
) -> GateDecision:
    """Gate one placeholder sample (its standalone base K/V) against a placeholder's pool.

    ≤ 1 pooled anchor, or ≤ 1 anchor at least as long as the sample (and, with
    `agent_id`, holding offsets for that agent): dense. Otherwise H =
    −Σ w·log2 w of the normalized softmax(−d/τ) weights over `metric` distances;
    H > γ·log2|A|: dense. Reusing, the anchors making up the `top_p` weight mass are
    activated. hidden_layer: which boundary state the "hidden" metric compares.
    """
    _check_gate(gamma, metric, top_p, hidden_layer)
    if len(pool) <= 1:
        return GateDecision(False, "pool_too_small")
    anchors = eligible_anchors(pool, query_base.num_tokens, agent_id)
    ids = tuple(a.anchor_id for a in anchors)
    if len(anchors) <= 1:
        return GateDecision(False, "too_few_eligible", ids)
    query, keyed = base_features(query_base, anchors, cast(Metric, metric), rope, hidden_layer)
    weights = anchor_weights(whole_distances(query, keyed), rms(query), tau)
    entropy = entropy_bits(weights)
    threshold = gamma * math.log2(len(anchors))
    listed = tuple(float(w) for w in weights)
    if entropy > threshold:
        return GateDecision(False, "ambiguous", ids, listed, entropy, threshold)
    active = top_p_ids(ids, weights, top_p)
    return GateDecision(True, "confident", ids, listed, entropy, threshold, active)


def entropy_bits(weights: torch.Tensor) -> float:
    """H = −Σ w·log2 w of a distribution [A] (0·log 0 = 0), in bits."""
    w = weights.double()
    terms = torch.where(w > 0, w * torch.log2(w.clamp(min=1e-300)), torch.zeros_like(w))
    return max(0.0, float(-terms.sum()))  # never -0.0


def top_p_ids(ids: Sequence[str], weights: torch.Tensor, top_p: float) -> tuple[str, ...]:
    """The heaviest ids whose cumulative weight first reaches `top_p` (ties: pool order)."""
    order = sorted(range(len(ids)), key=lambda i: (-float(weights[i]), i))
    chosen, mass = [], 0.0
    for i in order:
        chosen.append(ids[i])
        mass += float(weights[i])
        if mass >= top_p - 1e-9:
            break
    return tuple(chosen)


def _check_gate(gamma: float, metric: str, top_p: float, hidden_layer: int | None) -> None:
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma {gamma} must be in [0, 1]")
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r} is not one of {METRICS}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p {top_p} must be in (0, 1]")
    if metric == "hidden" and hidden_layer is None:
        raise ValueError("metric 'hidden' needs hidden_layer")


def exact_match(
    query_base: SegmentKV, pool: Sequence[Anchor], rope: RopeSpec, agent_id: str,
    *, exact_rtol: float = 1e-5,
) -> Anchor | None:  # fmt: skip
    """An anchor of the query's own sample: as long, holding `agent_id`'s offsets, its base
    within `exact_rtol`·RMS of the query's (keys moved to the query's positions first).

    Its offset is exactly the one the query needs (the weights' exact-match rule), so it
    needs no second anchor: KVComm's pool-size rule asks for evidence of how offsets vary
    across samples, which a sample seen before does not need.
    """
    for anchor in pool:
        base = anchor.base
        if base.num_tokens != query_base.num_tokens or anchor.offsets(agent_id) is None:
            continue
        delta = query_base.start_position - base.start_position
        keys = rope.shift_layers(base.keys.float(), delta, base.layer_start)
        close_v = rms(base.values.float() - query_base.values.float()) <= exact_rtol * rms(
            query_base.values
        )
        close_k = rms(keys - query_base.keys.float()) <= exact_rtol * rms(query_base.keys)
        if close_v and close_k:
            return anchor
    return None
