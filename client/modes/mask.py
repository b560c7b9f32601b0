"""Mode `mask`: the block-diagonal masking ablation of seed 001 (no cross-candidate attention).

A prompt's candidate blocks are its agent-output placeholders (`candidate_blocks`);
its shared prefix is everything before the first block. Each block is prefilled
after the shared prefix only, as if it directly followed it, and its keys are
rotated into place (Δ = block start − prefix length): a block attends to the
prefix and to itself, never to another block. Everything else (the text between
and after the blocks, the last token) is computed with full attention. Without
blocks the call is dense. It reads nothing from the store: the ablation isolates
the mask, not the reuse (its block prefills are in the TTFT).
"""

from __future__ import annotations

import logging

from kvsplice.client.execute.execution import timed
from kvsplice.client.execute.plan import CallPlan
from kvsplice.client.model.hf_cache import full_length_cache, read_layers, truncate
from kvsplice.client.modes.base import (
    CallContext,
    ModeSpec,
    PlanBuilder,
    PlannedCall,
    SpannedPrompt,
    candidate_blocks,
)
from kvsplice.client.modes.params import NoParams
from kvsplice.client.modes.recorder import RecordingPolicy
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

MODE = "mask"


class MaskPolicy(RecordingPolicy):
    mode = MODE

    def __init__(self, params: NoParams | None = None) -> None:
        self.params = params or NoParams()

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[None]:
        blocks = candidate_blocks(prompt)
        if not blocks:
            return PlannedCall(CallPlan.all_compute(prompt.token_ids))
        builder = PlanBuilder(prompt.token_ids)
        prefix_len = blocks[0].start
        with timed(ctx.timings, "base_prefill_s"):
            cache = full_length_cache()
            if prefix_len:
                ctx.executor.forward(prompt.token_ids[:prefix_len], 0, cache)
                keys, values = read_layers(cache, 0, prefix_len)
                builder.reuse(0, SegmentKV(keys, values, 0), MODE, exact=True, name="prefix")
            for block in blocks:
                ctx.executor.forward(prompt.token_ids[block.start : block.end], prefix_len, cache)
                keys, values = read_layers(cache, prefix_len, prefix_len + block.num_tokens)
                truncate(cache, prefix_len)
                kv = SegmentKV(keys, values, start_position=prefix_len)
                builder.reuse(block.start, kv, MODE, exact=False, name=block.candidate_id)
        return PlannedCall(builder.build())


SPEC = ModeSpec(MODE, NoParams, MaskPolicy, ablation=True)
