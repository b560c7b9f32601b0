"""Mode `blend` (CacheBlend): naive's reused spans, with the r% most deviating tokens recomputed.

Naive's plan decides what is reused (exact prefix, question base, upstream
answers, same-token text); its approximate spans become `blend_plan` chunks
(layers ≤ the check layer computed for every token, then only the selected
ones), while the exact prefix is read at every layer. r = 1 is dense.

Also owns which reused tokens keep being computed after the check layer (the top
r% by K/V deviation) and the plan that asks the layerwise executor for it:
reused chunks computed through layer 0 .. check layer for every token, then
only the selected ones (plus every non-reused token) from there on.

Default deviation: VALUE, Σ_{heads,channels}(V_new − V_old)² per token, as
CacheBlend's own code (xformers backend) and paper do. Values carry no RoPE,
so a score never mixes a rotation error into the context error, and the
attention output is a mix of values, so V deviation is what a token's reuse
error feeds forward directly. "key" (post-RoPE, LMCache's blender) is
available for comparison.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvsplice.client.execute.plan import CallPlan, KVPair, SubsetRule, segment_span, tile_spans
from kvsplice.client.execute.spans import reuse_spans
from kvsplice.client.modes.base import ModeSpec, SpannedPrompt
from kvsplice.client.modes.call_context import CallContext
from kvsplice.client.modes.naive import NaivePolicy
from kvsplice.client.modes.params import check_ranges, knob
from kvsplice.client.modes.planned_call import PlannedCall
from kvsplice.client.modes.recorder import WholeSpanRecordingPolicy
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

Deviation = Literal["value", "key"]


@dataclass(frozen=True)
class BlendConfig:
    """ratio r: fraction of reused tokens recomputed after `check_layer` (CacheBlend: 0.15)."""

    ratio: float = 0.15
    check_layer: int = 1
    deviation: Deviation = "value"

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio {self.ratio} must be in [0, 1]")
        if self.check_layer < 0:
            raise ValueError(f"check_layer {self.check_layer} must be >= 0")
        if self.deviation not in ("value", "key"):
            raise ValueError(f"deviation {self.deviation!r} must be 'value' or 'key'")


def num_selected(num_candidates: int, ratio: float) -> int:
    """floor(M·r) (CacheBlend's `int(total · ratio)`), robust to fp error in M·r."""
    return min(num_candidates, math.floor(num_candidates * ratio + 1e-9))


def token_deviation(new_kv: KVPair, old_kv: KVPair, deviation: Deviation) -> torch.Tensor:
    """[M] fp32: Σ over heads and channels of (new − old)² of keys or values [H_kv, M, D]."""
    index = 0 if deviation == "key" else 1
    diff = new_kv[index].float() - old_kv[index].float()
    return diff.square().sum(dim=(0, 2))


@dataclass(frozen=True)
class DeviationSelector:
    """A `TokenSelector`: the top floor(M·r) candidates by deviation, ascending indices."""

    ratio: float
    deviation: Deviation = "value"

    def __call__(self, layer_idx: int, new_kv: KVPair, old_kv: KVPair) -> torch.Tensor:
        scores = token_deviation(new_kv, old_kv, self.deviation)
        count = num_selected(int(scores.numel()), self.ratio)
        return torch.topk(scores, count, sorted=False).indices.sort().values


def blend_rule(config: BlendConfig) -> SubsetRule:
    """At the check layer, keep computing the top r% of reused tokens by deviation."""
    return SubsetRule(config.check_layer, DeviationSelector(config.ratio, config.deviation))


def blend_plan(
    token_ids: Sequence[int],
    chunks: Sequence[tuple[int, SegmentKV]],
    config: BlendConfig | None = None,
    *,
    position_offset: int = 0,
) -> CallPlan:
    """Reuse each (start slot, segment) chunk CacheBlend-style; other tokens computed.

    Chunks need K/V for every layer (their old K/V stand in for dropped tokens)
    and are computed from their embeddings, so layers ≤ check layer see true
    states (CacheBlend recomputes layer 0 fully). r = 1 is dense; r = 0 reuses
    the chunks' K/V of layers ≥ check layer (naive reuse for check layer ≤ 1,
    layer 0 K/V being context-free).
    """
    config = config or BlendConfig()
    spans = [
        segment_span(segment, start, start_layer=0, position_offset=position_offset,
                     name=f"blend@{start}")
        for start, segment in chunks
    ]  # fmt: skip
    ids = tuple(int(t) for t in token_ids)
    return CallPlan(
        ids, tile_spans(len(ids), spans), position_offset, subsets=(blend_rule(config),)
    )


MODE = "blend"


class BlendPolicy(WholeSpanRecordingPolicy):
    mode = MODE

    def __init__(self, config: BlendConfig | None = None) -> None:
        self.config = config or BlendConfig()

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[None]:
        naive = NaivePolicy().plan(prompt, ctx)
        if not any(s.source is not None and not s.source.exact for s in naive.plan.spans):
            return naive  # exact reuse or nothing: no token to blend
        spans = reuse_spans(naive.plan, approx_start_layer=0, mode=MODE)
        plan = CallPlan(naive.plan.token_ids, tuple(spans), subsets=(blend_rule(self.config),))
        return PlannedCall(plan, records=naive.records)


@dataclass(frozen=True)
class Params:
    """blend's parameters (`blend:r=0.43`)."""

    ratio: float = knob(
        0.15, "r", "CacheBlend's ratio: the share of reused tokens recomputed above the check layer",
        low=0, high=1, grid=(0.5, 0.3, 0.15),
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_ranges(self)


SPEC = ModeSpec(MODE, Params, lambda p: BlendPolicy(BlendConfig(ratio=p.ratio)))
