"""KVComm anchors as the client sees them: base K/V, per-agent offsets, the length rule, features.

Owns the tensors of one anchor (fetched from the store) and the comparison
features of base caches. Pool bookkeeping (ids, use counts, eviction) lives in
`kvsplice.index.anchor_pool`; weights in `weights`, corrections in
`correction`, the reuse-or-dense decision in `gate`.
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
