"""Mode `exact`: reuse only stored segments whose whole left context equals the prompt's.

`plan_exact_prefix` walks the store's chained keys over the prompt's real ids
(`lookup_prefix`), fetches the run and reuses it at Δ = 0; the rest is computed.
Spliced logits equal dense prefill up to summation order (and the payload's
quantization: use quant "none" where bit-level fidelity matters).
"""

from __future__ import annotations

import logging
import time

from kvsplice.client.execute.call_timings import timed
from kvsplice.client.modes.base import ModeSpec, PlanBuilder, SpannedPrompt
from kvsplice.client.modes.call_context import CallContext, StoreContext
from kvsplice.client.modes.params import NoParams
from kvsplice.client.modes.planned_call import PlannedCall
from kvsplice.client.modes.recorder import RecordingPolicy
from kvsplice.client.store.local_tier import on_device
from kvsplice.client.store.segment_io import fetch_segment
from kvsplice.client.store.store_types import SegmentRef
from kvsplice.common.chain import continues
from kvsplice.common.keys import root_key
from kvsplice.common.segment import SegmentMeta
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)


class ExactPolicy(RecordingPolicy):
    mode = "exact"

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[None]:
        builder = PlanBuilder(prompt.token_ids)
        plan_exact_prefix(prompt, ctx, builder)
        return PlannedCall(builder.build())


def plan_exact_prefix(prompt: SpannedPrompt, ctx: CallContext, builder: PlanBuilder) -> bytes:
    """Add the stored run matching the prompt from position 0 to `builder`.

    The sidecar's index says which segments exist; each is taken from the
    worker's local tier when held there (no fetch, no decode), else fetched and
    then kept locally. Past the end of the sidecar's run, only this worker's
    own segments whose puts are still in flight continue the chain; a local
    segment the sidecar no longer lists (expired, deleted, evicted) is dropped.
    Stops at the first segment that misses or disagrees with the prompt. Returns
    the context key of the reused run (the root key when nothing matched).
    """
    parent = root_key(ctx.fingerprint)
    if not isinstance(ctx, StoreContext):
        return parent
    listed_at_s = time.monotonic()
    with timed(ctx.timings, "lookup_s"):
        lookup = ctx.store.lookup_prefix(ctx.fingerprint, prompt.token_ids)
    refs = {ref.start_position: ref for ref in lookup.segments}
    position, num_tokens = 0, len(prompt.token_ids)
    while position < num_tokens:
        ref = refs.get(position)
        link = _next_link(ctx, ref, parent, prompt.token_ids, position, listed_at_s)
        if link is None:
            break
        meta, kv = link
        builder.reuse(
            position, kv, "exact", exact=True, chain_key=meta.context_key,
            chain_num_tokens=meta.num_tokens, name=f"prefix@{position}",
        )  # fmt: skip
        parent, position = meta.context_key, position + meta.num_tokens
    return parent


def _next_link(
    ctx: StoreContext,
    ref: SegmentRef | None,
    parent: bytes,
    token_ids: tuple[int, ...],
    position: int,
    listed_at_s: float,
) -> tuple[SegmentMeta, SegmentKV] | None:
    """The segment continuing the chain at `position`, from the local tier or the sidecar."""
    local = ctx.local
    if ref is None:  # the sidecar's run ended: only puts newer than its listing may go on
        key = local.child(parent, token_ids, position)
        entry = None if key is None else local.get(key)
        if entry is None:
            return None
        if entry.unlisted_is_stale(listed_at_s):
            local.invalidate(entry.meta.context_key)
            return None
        return entry.meta, entry.kv
    tokens = token_ids[position : position + ref.num_tokens]
    entry = local.get(ref.context_key)
    if entry is not None and continues(entry.meta, parent, tokens, position):
        return entry.meta, entry.kv
    return _fetch(ctx, ref, parent, tokens, position)


def _fetch(
    ctx: StoreContext, ref: SegmentRef, parent: bytes, tokens: tuple[int, ...], position: int
) -> tuple[SegmentMeta, SegmentKV] | None:
    fetched = fetch_segment(
        ctx.store,
        ref.segment_id,
        fingerprint=ctx.fingerprint,
        dtype=ctx.decode_dtype,
        timings=ctx.timings,
    )
    if fetched is None or not continues(fetched.meta, parent, tokens, position):
        return None
    kv = on_device(fetched.kv, ctx.local.device)
    ctx.local.put(fetched.meta, kv)
    return fetched.meta, kv


SPEC = ModeSpec("exact", NoParams, lambda _: ExactPolicy(), chain_only=True, drifts=False)
