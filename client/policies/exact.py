"""Mode `exact`: reuse only stored segments whose whole left context equals the prompt's.

`plan_exact_prefix` walks the store's chained keys over the prompt's real ids
(`lookup_prefix`), fetches the run and reuses it at Δ = 0; the rest is computed.
Spliced logits equal dense prefill up to summation order (and the payload's
quantization: use quant "none" where bit-level fidelity matters).
"""

from __future__ import annotations

import logging

from kvsplice.client.call_timings import timed
from kvsplice.client.policies.base import CallContext, PlanBuilder, SpannedPrompt
from kvsplice.client.policies.recorder import RecordingPolicy
from kvsplice.client.reuse_plan import Reuse, ReusePlan
from kvsplice.client.segment_io import fetch_segment
from kvsplice.common.keys import root_key
from kvsplice.common.segment import SegmentMeta

logger = logging.getLogger(__name__)


class ExactPolicy(RecordingPolicy):
    mode = "exact"

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> ReusePlan:
        builder = PlanBuilder(prompt.token_ids)
        plan_exact_prefix(prompt, ctx, builder)
        return builder.build()


def plan_exact_prefix(prompt: SpannedPrompt, ctx: CallContext, builder: PlanBuilder) -> bytes:
    """Add the stored run matching the prompt from position 0 to `builder`.

    Stops at the first segment that misses or disagrees with the prompt. Returns
    the context key of the reused run (the root key when nothing matched).
    """
    parent = root_key(ctx.fingerprint)
    if ctx.store is None:
        return parent
    with timed(ctx.timings, "lookup_s"):
        lookup = ctx.store.lookup_prefix(ctx.fingerprint, prompt.token_ids)
    position = 0
    for ref in lookup.segments:
        fetched = fetch_segment(
            ctx.store,
            ref.segment_id,
            fingerprint=ctx.fingerprint,
            dtype=ctx.decode_dtype,
            timings=ctx.timings,
        )
        tokens = prompt.token_ids[position : position + ref.num_tokens]
        if fetched is None or not _continues(fetched.meta, parent, tokens, position):
            break
        action = Reuse(fetched.kv, "exact", True, fetched.meta.context_key, fetched.meta.num_tokens)
        builder.reuse(position, action, f"prefix@{position}")
        parent, position = fetched.meta.context_key, position + ref.num_tokens
    return parent


def _continues(meta: SegmentMeta, parent: bytes, tokens: tuple[int, ...], position: int) -> bool:
    """The fetched segment really is the next link: same parent, tokens and position."""
    return (
        meta.parent_key == parent and meta.token_ids == tokens and meta.start_position == position
    )
