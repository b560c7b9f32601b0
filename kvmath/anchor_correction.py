"""KVComm's offset correction (seed 002): a span's K/V in a new context from its base and anchors.

`correct`: base + Σ_a w_a · offset_a (layers ≥ 1), the weights from `anchors`. Whether
to correct at all is the gate's (`anchor_gate.decide`); fetching anchors and placing the
result are the engine's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvsplice.kvmath.anchors import (
    AgentOffsets,
    Anchor,
    anchor_weights,
    base_features,
    rms,
    token_distances,
    whole_distances,
)
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

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
