"""Mode `blend` (CacheBlend): naive's reused spans, with the r% most deviating tokens recomputed.

Naive's plan decides what is reused (exact prefix, question base, upstream
answers, same-token text); its approximate spans become `blend_plan` chunks
(layers ≤ the check layer computed for every token, then only the selected
ones), while the exact prefix is read at every layer. r = 1 is dense.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvsplice.client.modes.blend import BlendConfig, blend_plan
from kvsplice.client.modes.spans import replace_spans, tile_spans
from kvsplice.client.policies.base import CallContext, SpannedPrompt
from kvsplice.client.policies.layerwise_call import LayerwiseCall, reuse_spans, whole_span_records
from kvsplice.client.policies.naive import NaivePolicy
from kvsplice.client.policies.recorder import call_records, put_records
from kvsplice.client.reuse_plan import Reuse, ReusePlan
from kvsplice.client.span_executor import ExecutionState

logger = logging.getLogger(__name__)

MODE = "blend"


class BlendPolicy:
    mode = MODE

    def __init__(self, config: BlendConfig | None = None) -> None:
        self.config = config or BlendConfig()

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> ReusePlan | LayerwiseCall:
        naive = NaivePolicy().plan(prompt, ctx)
        chunks = [
            (s.start, s.action.segment)
            for s in naive.reused_spans
            if isinstance(s.action, Reuse) and not s.action.exact
        ]
        if not chunks:
            return naive  # exact reuse or nothing: no token to blend
        assert ctx.rope is not None and ctx.layerwise_executor is not None
        num_layers = ctx.layerwise_executor().num_layers
        spans, sources = reuse_spans(naive, ctx.rope, num_layers, approx_start_layer=0, mode=MODE)
        blended = blend_plan(naive.token_ids, chunks, ctx.rope, self.config)
        exact = [s for s in spans if s.keys is not None and s.start_layer == num_layers]
        chunk_spans = [s for s in blended.spans if s.keys is not None]
        plan = replace_spans(blended, tile_spans(naive.num_tokens, exact + chunk_spans))
        return LayerwiseCall(plan, sources)

    def after_call(
        self,
        prompt: SpannedPrompt,
        plan: ReusePlan,
        state: ExecutionState,
        ctx: CallContext,
        response_ids: Sequence[int],
    ) -> None:
        records = call_records(prompt, plan, state, ctx, response_ids)
        put_records(ctx, whole_span_records(records, prompt.spans))
