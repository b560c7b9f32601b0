"""KVComm's anchors (seed 002), engine-neutral: base K/V and per-agent offsets, and their weights.

Owns the tensors of one anchor (fetched from the store), the comparison features of
base caches, the anchor weights computed from their distances (pure tensor math:
RMS distance, normalization, softmax(−d/τ)), the reuse-or-dense decision on them
(`anchor_gate.decide`) and the correction they weight (`anchor_correction.correct`)
live beside it; both engines (the HF loop's `anchor` mode, the vLLM connector) use them. Pool bookkeeping
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

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
