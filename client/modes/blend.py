"""Mode `blend` (CacheBlend): naive's reused spans, with the r% most deviating tokens recomputed.

The position-only plan (`shared.plan_position_only`: exact prefix, question base,
upstream answers, same-token text) decides what is reused; its approximate spans are
computed through layers ≤ the check layer for every token, then only for the
selected ones (`shared.blend_rule`), while the exact prefix is read at every layer.
r = 1 is dense.

Default deviation: VALUE, Σ_{heads,channels}(V_new − V_old)² per token, as
CacheBlend's own code (xformers backend) and paper do. Values carry no RoPE,
so a score never mixes a rotation error into the context error, and the
attention output is a mix of values, so V deviation is what a token's reuse
error feeds forward directly. "key" (post-RoPE, LMCache's blender) is
available for comparison.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from kvsplice.client.execute.plan import CallPlan
from kvsplice.client.modes.base import CallContext, ModeSpec, PlannedCall, SpannedPrompt
from kvsplice.client.modes.params import check_ranges, knob
from kvsplice.client.modes.recorder import WholeSpanRecordingPolicy
from kvsplice.client.modes.shared import DEVIATIONS, blend_rule, plan_position_only, reuse_spans

logger = logging.getLogger(__name__)

MODE = "blend"


@dataclass(frozen=True)
class Params:
    """blend's parameters (`blend:r=0.43`): ratio r, the share of reused tokens recomputed
    after `check_layer` (CacheBlend: 0.15), chosen by `deviation`."""

    ratio: float = knob(
        0.15, "r", "CacheBlend's ratio: the share of reused tokens recomputed above the check layer",
        low=0, high=1, grid=(0.5, 0.3, 0.15),
    )  # fmt: skip
    check_layer: int = knob(
        1, "check", "layers up to it computed for every reused token", variant=False
    )
    deviation: Literal["value", "key"] = knob(
        "value", "deviation", "what ranks tokens: value (CacheBlend) or key", variant=False
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.check_layer < 0:
            raise ValueError(f"check_layer {self.check_layer} must be >= 0")
        if self.deviation not in DEVIATIONS:
            raise ValueError(f"deviation {self.deviation!r} must be 'value' or 'key'")


class BlendPolicy(WholeSpanRecordingPolicy):
    mode = MODE

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or Params()

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[None]:
        naive = plan_position_only(prompt, ctx, MODE)
        if not any(s.source is not None and not s.source.exact for s in naive.plan.spans):
            return naive  # exact reuse or nothing: no token to blend
        spans = reuse_spans(naive.plan, approx_start_layer=0, mode=MODE)
        params = self.params
        rule = blend_rule(params.check_layer, params.ratio, params.deviation)
        plan = CallPlan(naive.plan.token_ids, tuple(spans), subsets=(rule,))
        return PlannedCall(plan, records=naive.records)


SPEC = ModeSpec(MODE, Params, BlendPolicy)
