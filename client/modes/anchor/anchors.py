"""KVComm's anchor math: base K/V and per-agent offsets, their weights, the gate, the correction.

Owns the tensors of one anchor (fetched from the store), the comparison features of
base caches, the anchor weights computed from their distances (pure tensor math:
RMS distance, normalization, softmax(−d/τ)), the reuse-or-dense decision on them
(`decide`, the gate) and the correction they weight (`correct`). Pool bookkeeping
(ids, use counts, eviction) lives in `kvsplice.index.anchor_pool`; reading pools and
the byte form in `pools`; when to gate, correct or add an anchor is the policy's.

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
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

import torch

from kvsplice.client.execute.plan import PlanSpan
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

Metric = Literal["value", "key", "hidden"]
METRICS: tuple[Metric, ...] = ("value", "key", "hidden")
Normalization = Literal["median", "query_rms"]
NORMALIZATIONS: tuple[Normalization, ...] = ("median", "query_rms")


@dataclass(frozen=True, eq=False)
class AgentOffsets:
    """One anchor's offsets inside one agent's prompt (real − base, see `kv_offset`).

    placeholder: [L, H_kv, T_a, D], keys post-RoPE at `placeholder.start_position`,
    the placeholder's position in the prompt that made the anchor. prefix: the
    same for the template text right after the placeholder (None: not recorded).
    """

    placeholder: SegmentKV
    prefix: SegmentKV | None = None


@dataclass(frozen=True, eq=False)
class Anchor:
    """A placeholder sample: its standalone base K/V and, per agent id, its offsets.

    base: [L, H_kv, T_a, D], the placeholder prefilled alone (keys at
    `base.start_position`, usually 0; boundary states optional, for the
    "hidden" metric). Offsets are looked up by agent id only, so one agent's
    offsets (made at its positions, in its context) never serve another.
    """

    anchor_id: str
    base: SegmentKV
    offsets_by_agent: Mapping[str, AgentOffsets] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return self.base.num_tokens

    def offsets(self, agent_id: str) -> AgentOffsets | None:
        return self.offsets_by_agent.get(agent_id)


def kv_offset(real: SegmentKV, base: SegmentKV, rope: RopeSpec) -> SegmentKV:
    """real − base as a segment at `real.start_position` (an anchor's offset for one agent).

    base keys are Δ-shifted to real's positions first, so the difference is of
    keys at the same positions; keys of the offset are post-RoPE at
    `real.start_position` and can be Δ-shifted like keys (R(Δ) is linear).
    """
    if real.keys.shape != base.keys.shape or real.layer_start != base.layer_start:
        raise ValueError(
            f"real {tuple(real.keys.shape)} and base {tuple(base.keys.shape)} K/V differ in shape"
        )
    base_keys = rope.shift_layers(
        base.keys.float(), real.start_position - base.start_position, base.layer_start
    )
    return SegmentKV(
        real.keys.float() - base_keys,
        real.values.float() - base.values.float(),
        start_position=real.start_position,
        layer_start=real.layer_start,
    )


def eligible_anchors(
    anchors: Sequence[Anchor], num_tokens: int, agent_id: str | None = None
) -> list[Anchor]:
    """KVComm's length rule: anchors at least `num_tokens` long (the first T tokens align).

    With `agent_id`, also only anchors holding offsets for that agent (the
    correction could not use the others). Pool order is kept.
    """
    return [
        a
        for a in anchors
        if a.num_tokens >= num_tokens and (agent_id is None or a.offsets(agent_id) is not None)
    ]


def base_features(
    query: SegmentKV,
    anchors: Sequence[Anchor],
    metric: Metric,
    rope: RopeSpec,
    hidden_layer: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-major features of the first T base tokens: query [T, F], anchors [A, T, F] (fp32).

    "value": base V of every layer, heads, channels. "key": base K, each anchor's
    keys Δ-shifted to the query's positions first (KVCOMM compares keys sitting
    at different positions, its bug 4). "hidden": `boundary_states[hidden_layer]`.
    """
    num_tokens = query.num_tokens
    if any(a.num_tokens < num_tokens for a in anchors):
        raise ValueError(f"an anchor is shorter than the query's {num_tokens} tokens")
    query_features = _features(query, metric, hidden_layer, num_tokens)
    rows = [_features(_aligned(a.base, query, metric, rope), metric, hidden_layer, num_tokens)
            for a in anchors]  # fmt: skip
    stacked = torch.stack(rows) if rows else query_features.new_zeros((0, *query_features.shape))
    return query_features, stacked


def _aligned(base: SegmentKV, query: SegmentKV, metric: Metric, rope: RopeSpec) -> SegmentKV:
    if metric != "key" or base.start_position == query.start_position:
        return base
    keys = rope.shift_layers(
        base.keys.float(), query.start_position - base.start_position, base.layer_start
    )
    return SegmentKV(keys, base.values, query.start_position, base.layer_start)


def _features(
    segment: SegmentKV, metric: Metric, hidden_layer: int | None, num_tokens: int
) -> torch.Tensor:
    """[T, F] fp32: per token, the chosen base tensor flattened over layers, heads, channels."""
    if metric == "hidden":
        if hidden_layer is None or hidden_layer not in segment.boundary_states:
            raise ValueError(f"metric 'hidden' needs boundary_states[{hidden_layer}]")
        return segment.boundary_states[hidden_layer][:num_tokens].float()
    if metric not in METRICS:
        raise ValueError(f"metric {metric!r} is not one of {METRICS}")
    kv = segment.keys if metric == "key" else segment.values
    return kv[:, :, :num_tokens].float().permute(2, 0, 1, 3).reshape(num_tokens, -1)


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
    distances: torch.Tensor,
    query_scale: float,
    tau: float = 0.1,
    *,
    normalize: Normalization = "median",
    exact_rtol: float = 1e-5,
) -> torch.Tensor:
    """distances [A, ...] >= 0 -> weights [A, ...] summing to 1 over dim 0.

    query_scale: RMS of the query's features (the exact-match tolerance and the
    "query_rms" scale). Columns with an exact match (distance ≤ `exact_rtol`·scale)
    split the weight equally among their exact anchors; the others get
    softmax(−normalized d / τ), normalized as `normalize` says (see the module docstring).
    """
    _check_weighting(tau, normalize, exact_rtol)
    if distances.shape[0] == 0:
        raise ValueError("weights need at least one anchor")
    distances = distances.double()
    soft = torch.softmax(-normalized(distances, query_scale, normalize) / tau, dim=0)
    exact = distances <= exact_rtol * query_scale
    has_exact = exact.any(dim=0, keepdim=True)
    split = exact.double() / exact.sum(dim=0, keepdim=True).clamp(min=1)
    return torch.where(has_exact, split, soft).float()


def normalized(
    distances: torch.Tensor, query_scale: float, normalize: Normalization = "median"
) -> torch.Tensor:
    """distances [A, ...] divided by the `normalize` scale (a zero scale leaves them as is)."""
    if normalize == "query_rms":
        return distances / query_scale if query_scale > 0 else distances
    median = torch.quantile(distances, 0.5, dim=0, keepdim=True)
    return distances / torch.where(median > 0, median, torch.ones_like(median))


def _check_weighting(tau: float, normalize: str, exact_rtol: float) -> None:
    if not tau > 0:
        raise ValueError(f"tau {tau} must be > 0")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize {normalize!r} is not one of {NORMALIZATIONS}")
    if exact_rtol < 0:
        raise ValueError(f"exact_rtol {exact_rtol} must be >= 0")


# The gate (KVComm's): reuse with a correction, or prefill densely and store a new anchor.
#
# `decide` owns the decision (length rule, then the entropy of the anchor weights in
# bits against γ·log2|A|) and the ids whose use count to bump. It does not
# touch the pool (`AnchorPool.touch`/`add` are the caller's) and computes no K/V.
#
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


# The offset correction (KVComm's): approximate a placeholder's (and the next text's) K/V
# in one agent. `correct`: base + Σ_a w_a · offset_a, with the weights above;
# `anchor_spans` turns a correction into full-reuse plan spans. Whether to reuse at
# all is the gate's decision; fetching anchors is the policy's.
#
# Weights (our choice, and why; KVComm's public code differs, see notes §1):
# - placeholder, per token t and per K/V kind: distances over the first T base
#   tokens of query and anchor (same positions, keys aligned), all layers,
#   heads, channels. Per token because token t's real K/V depends only on the
#   agent's context and placeholder tokens ≤ t (causality): an anchor sharing
#   the query's first k tokens gets all the weight on those tokens, where its
#   offset is exact.
# - next text ("prefix" in KVComm), one weight per anchor and kind: the text
#   attends to the whole placeholder, so the whole-placeholder distance decides.
#   KVComm's per-(layer, head, channel) weights over the anchor's *last* T tokens
#   mix anchors channel by channel into keys no context produces, and compare
#   keys at different positions.
# - Layer 0 is never corrected: layer-0 K/V depend only on the token and its
#   position, so the shifted base already equals the real layer 0.
# Nothing is cached, so weights cannot leak across agents; offsets are looked up
# by the query's agent id.


@dataclass(frozen=True, eq=False)
class AnchorQuery:
    """A placeholder sample to place in one agent's prompt.

    base: its standalone K/V [L, H_kv, T, D] (keys at `base.start_position`);
    position: where its first token goes in the agent's prompt; next_base: the
    following template text's base K/V (any start position; it goes to
    `position + T`), or None to correct the placeholder only.
    """

    agent_id: str
    base: SegmentKV
    position: int
    next_base: SegmentKV | None = None

    @property
    def num_tokens(self) -> int:
        return self.base.num_tokens


@dataclass(frozen=True, eq=False)
class KVWeights:
    """Weights of the anchors `anchor_ids` for keys and for values: [A, T] or [A]."""

    keys: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True, eq=False)
class AnchorCorrection:
    """Approximate K/V (fp32) at the query's positions and the weights that made them."""

    placeholder: SegmentKV
    next_text: SegmentKV | None
    anchor_ids: tuple[str, ...]
    placeholder_weights: KVWeights
    next_weights: KVWeights | None


def correct(
    query: AnchorQuery,
    anchors: Sequence[Anchor],
    rope: RopeSpec,
    tau: float = 0.1,
) -> AnchorCorrection:
    """K̂ = shift(base) + Σ_a w_a · shift(Δ_a), V̂ likewise, for layers ≥ 1 (layer 0: base).

    anchors: eligible ones (see `eligible_anchors`): at least T tokens and
    offsets for `query.agent_id` (and next-text offsets when `query.next_base`
    is given). Placeholder offsets use the anchor's first T tokens.
    """
    offsets = _offsets_of(query, anchors)
    features = [base_features(query.base, anchors, kind, rope) for kind in ("key", "value")]
    ph_weights = _weights(features, token_distances, tau)
    placeholder = _apply(
        query.base, [o.placeholder for o in offsets], ph_weights, query.position, rope
    )  # fmt: skip
    next_text, next_weights = None, None
    if query.next_base is not None:
        next_weights = _weights(features, whole_distances, tau)
        deltas = [o.prefix for o in offsets if o.prefix is not None]
        next_position = query.position + query.num_tokens
        next_text = _apply(query.next_base, deltas, next_weights, next_position, rope)
    ids = tuple(a.anchor_id for a in anchors)
    return AnchorCorrection(placeholder, next_text, ids, ph_weights, next_weights)


def anchor_spans(
    correction: AnchorCorrection, position_offset: int = 0, name: str = "anchor"
) -> tuple[PlanSpan, ...]:
    """Full-reuse spans (every layer reads the corrected K/V) for a plan at `position_offset`."""
    segments = [correction.placeholder]
    if correction.next_text is not None:
        segments.append(correction.next_text)
    spans = []
    for part, segment in zip(("placeholder", "next"), segments, strict=False):
        start = segment.start_position - position_offset
        spans.append(PlanSpan(
            start, start + segment.num_tokens, segment.num_layers, segment,
            name=f"{name}:{part}",
        ))  # fmt: skip
    return tuple(spans)


def _offsets_of(query: AnchorQuery, anchors: Sequence[Anchor]) -> list[AgentOffsets]:
    if not anchors:
        raise ValueError("a correction needs at least one eligible anchor")
    offsets = []
    for anchor in anchors:
        found = anchor.offsets(query.agent_id)
        if found is None or anchor.num_tokens < query.num_tokens:
            raise ValueError(
                f"anchor {anchor.anchor_id!r} is not eligible for agent {query.agent_id!r} "
                f"and {query.num_tokens} tokens"
            )
        if query.next_base is not None and not _next_fits(found, query.next_base):
            raise ValueError(
                f"anchor {anchor.anchor_id!r} has no next-text offset of "
                f"{query.next_base.num_tokens} tokens for agent {query.agent_id!r}"
            )
        offsets.append(found)
    return offsets


def _next_fits(offsets: AgentOffsets, next_base: SegmentKV) -> bool:
    return offsets.prefix is not None and offsets.prefix.keys.shape == next_base.keys.shape


def _weights(
    features: list[tuple[torch.Tensor, torch.Tensor]],
    distance: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    tau: float,
) -> KVWeights:
    """features: (query, anchors) of aligned base keys, then of base values -> [A, T] or [A]."""
    keys, values = (anchor_weights(distance(q, a), rms(q), tau) for q, a in features)
    return KVWeights(keys, values)


def _apply(
    base: SegmentKV,
    deltas: Sequence[SegmentKV],
    weights: KVWeights,
    position: int,
    rope: RopeSpec,
) -> SegmentKV:
    """shift(base) + Σ_a w_a · shift(delta_a[:T]) at `position`; layer 0 stays the base.

    base: [L, H_kv, T, D]; deltas: [L, H_kv, T_a >= T, D] at their own positions;
    weights: [A, T] (per token) or [A].
    """
    num_tokens = base.num_tokens
    keys = rope.shift_layers(base.keys.float(), position - base.start_position, base.layer_start)
    values = base.values.float().clone()
    delta_keys = torch.stack([
        rope.shift_layers(d.keys[:, :, :num_tokens].float(), position - d.start_position, d.layer_start)
        for d in deltas
    ])  # fmt: skip
    delta_values = torch.stack([d.values[:, :, :num_tokens].float() for d in deltas])
    first = 1 if base.layer_start == 0 else 0  # layer 0 K/V does not depend on context
    keys[first:] += _weighted_sum(weights.keys, delta_keys)[first:]
    values[first:] += _weighted_sum(weights.values, delta_values)[first:]
    return SegmentKV(keys, values, start_position=position, layer_start=base.layer_start)


def _weighted_sum(weights: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """weights [A, T] or [A], deltas [A, L, H, T, D] -> [L, H, T, D]."""
    if weights.dim() == 2:
        return torch.einsum("at,alhtd->lhtd", weights, deltas)
    return torch.einsum("a,alhtd->lhtd", weights, deltas)
