"""Mode `dense`: compute every prompt token; the reference every other mode is measured against.

It still runs through the span executor (and stores its segments afterwards),
so its timings and outputs are comparable with the reuse modes'.
"""

from __future__ import annotations

import logging

from kvsplice.client.policies.base import CallContext, SpannedPrompt
from kvsplice.client.policies.recorder import RecordingPolicy
from kvsplice.client.reuse_plan import ReusePlan

logger = logging.getLogger(__name__)


class DensePolicy(RecordingPolicy):
    mode = "dense"

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> ReusePlan:
        return ReusePlan.all_compute(prompt.token_ids)
