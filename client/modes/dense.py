"""Mode `dense`: compute every prompt token; the reference every other mode is measured against.

It still runs through the executor (and stores its segments afterwards),
so its timings and outputs are comparable with the reuse modes'.
"""

from __future__ import annotations

import logging

from kvsplice.client.execute.plan import CallPlan
from kvsplice.client.modes.base import CallContext, ModeSpec, PlannedCall, SpannedPrompt
from kvsplice.client.modes.params import NoParams
from kvsplice.client.modes.recorder import RecordingPolicy
from kvsplice.common.reuse_modes import DENSE

logger = logging.getLogger(__name__)


class DensePolicy(RecordingPolicy):
    mode = DENSE

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[None]:
        return PlannedCall(CallPlan.all_compute(prompt.token_ids))


SPEC = ModeSpec(DENSE, NoParams, lambda _: DensePolicy(), chain_only=True, drifts=False)
