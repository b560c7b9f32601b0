"""Mode `exact`: reuse only stored segments whose whole left context equals the prompt's.

`shared.plan_exact_prefix` walks the store's chained keys over the prompt's real ids
(`lookup_prefix`), fetches the run and reuses it at Δ = 0; the rest is computed.
Spliced logits equal dense prefill up to summation order (and the payload's
quantization: use quant "none" where bit-level fidelity matters).
"""

from __future__ import annotations

import logging

from kvsplice.client.modes.base import (
    CallContext,
    ModeSpec,
    PlanBuilder,
    PlannedCall,
    SpannedPrompt,
)
from kvsplice.client.modes.params import NoParams
from kvsplice.client.modes.recorder import RecordingPolicy
from kvsplice.client.modes.shared import plan_exact_prefix
from kvsplice.common.reuse_modes import EXACT

logger = logging.getLogger(__name__)


class ExactPolicy(RecordingPolicy):
    mode = EXACT

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[None]:
        builder = PlanBuilder(prompt.token_ids)
        plan_exact_prefix(prompt, ctx, builder)
        return PlannedCall(builder.build())


SPEC = ModeSpec(EXACT, NoParams, lambda _: ExactPolicy(), chain_only=True, drifts=False)
