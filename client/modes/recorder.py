"""After a call: put the K/V it computed into the store, chained so later calls can hit.

Every span of the prompt that this call computed is stored as its own segment
(spans are the unit of reuse, and skipping a short one would break the key chain
of every span after it), and so is the generated response. Spans already in the
store (exact reuse) are not put again. K/V computed on top of approximate reuse
goes off-chain (`common.keys.off_chain_key`). Runs after the first
token: its time is the call's `store_s`, never part of the TTFT.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from kvsplice.client.execute.execution import ExecutionState, ReusedRange
from kvsplice.client.modes.base import (
    CallContext,
    PlannedCall,
    PromptSpan,
    SpannedPrompt,
    StoreContext,
)
from kvsplice.client.tiers.segment_io import DirectPuts, SpanRecord, left_tail
from kvsplice.common.keys import KeyChain, context_key
from kvsplice.common.segment import SegmentKind

logger = logging.getLogger(__name__)


class _Chain(KeyChain):
    """The key chain of a call's prompt, and how much of it stored segments already cover."""

    def __init__(self, fingerprint: str) -> None:
        super().__init__(fingerprint)
        self.stored_until = 0  # prompt tokens already covered by stored segments

    def follow_reuse(self, reused: ReusedRange, tokens: Sequence[int]) -> None:
        source = reused.source
        assert source is not None
        if self.exact and source.exact and source.chain_key is not None:
            self.parent = source.chain_key
            self.stored_until = reused.start + source.chain_num_tokens
            return
        self.leave_exact()
        self.parent = context_key(self.parent, tokens)

    def record(
        self,
        ctx: CallContext,
        state: ExecutionState,
        token_ids: Sequence[int],
        start: int,
        end: int,
    ) -> SpanRecord:
        tokens = tuple(token_ids[start:end])
        kind: SegmentKind = "prompt" if start < state.prompt_len else "response"
        record = SpanRecord(
            kv=ctx.executor.read_kv(state, start, end),
            token_ids=tokens,
            parent_key=self.parent,
            left_tail_ids=left_tail(token_ids, start),
            index_text=ctx.decode_text(tokens),
            kind=kind,
            exact=self.exact,
        )
        self.parent = record.context_key
        return record


def call_records(
    prompt: SpannedPrompt,
    planned: PlannedCall[Any],
    state: ExecutionState,
    ctx: CallContext,
    response_ids: Sequence[int],
) -> list[SpanRecord]:
    """What `RecordingPolicy` stores: `planned.records`, then this call's new segments, in order."""
    return list(planned.records) + _new_records(prompt, state, ctx, response_ids)


def put_records(ctx: CallContext, records: Sequence[SpanRecord]) -> int:
    """Put `records` now, in order until one fails; returns how many were stored."""
    if not isinstance(ctx, StoreContext):
        return 0
    puts = DirectPuts(ctx.store, fingerprint=ctx.fingerprint, quant=ctx.quant, local=ctx.local)
    return len(puts.submit(records))


def _new_records(
    prompt: SpannedPrompt, state: ExecutionState, ctx: CallContext, response_ids: Sequence[int]
) -> list[SpanRecord]:
    reuse = state.reuse
    chain = _Chain(ctx.fingerprint)
    records: list[SpanRecord] = []
    for span in reuse.ranges:
        if span.source is not None:
            chain.follow_reuse(span, reuse.token_ids[span.start : span.end])
            continue
        for start, end in _pieces(span, prompt.spans, chain.stored_until):
            records.append(chain.record(ctx, state, reuse.token_ids, start, end))
    if response_ids:
        full = reuse.token_ids + tuple(response_ids)
        records.append(chain.record(ctx, state, full, reuse.num_tokens, len(full)))
    return records


def _pieces(
    span: ReusedRange, prompt_spans: Sequence[PromptSpan], stored_until: int
) -> Iterator[tuple[int, int]]:
    """A computed range cut at the prompt's span boundaries, minus what is already stored."""
    start = max(span.start, stored_until)
    for prompt_span in prompt_spans:
        lo, hi = max(start, prompt_span.start), min(span.end, prompt_span.end)
        if lo < hi:
            yield lo, hi


class RecordingPolicy:
    """Base of the policies: after a call with a store, store what it computed
    (`call_records`) as `store_records` says: by default handed to `ctx.writer` (the
    engine's writer thread, or `DirectPuts`); a policy that stores otherwise overrides
    only `store_records`."""

    def after_call(
        self,
        prompt: SpannedPrompt,
        planned: PlannedCall[Any],
        state: ExecutionState,
        ctx: CallContext,
        response_ids: Sequence[int],
    ) -> None:
        if isinstance(ctx, StoreContext):
            batch = call_records(prompt, planned, state, ctx, response_ids)
            self.store_records(ctx, prompt, state, batch)

    def store_records(
        self, ctx: StoreContext, prompt: SpannedPrompt, run: ExecutionState, batch: list[SpanRecord]
    ) -> None:
        """Store `batch`, the call's records in chain order (`run`: the execution that
        computed them)."""
        ctx.writer.submit(batch)


class WholeSpanRecordingPolicy(RecordingPolicy):
    """Base of the policies that compute scattered tokens inside reused spans (blend, halo,
    crossfix): after a call, put its segments but the partial approximate prompt pieces
    (`whole_span_records`), synchronously."""

    def store_records(
        self, ctx: StoreContext, prompt: SpannedPrompt, run: ExecutionState, batch: list[SpanRecord]
    ) -> None:
        put_records(ctx, whole_span_records(batch, prompt.spans))


def whole_span_records(
    records: Sequence[SpanRecord], prompt_spans: Sequence[PromptSpan]
) -> list[SpanRecord]:
    """`records` without approximate prompt pieces that cover only part of a prompt span.

    Blend and halo compute scattered tokens inside reused spans; storing those
    as one- or few-token off-chain segments would only fill the index.
    """
    whole = {(s.start, s.end) for s in prompt_spans}
    return [r for r in records if not _partial_approximate(r, whole)]


def _partial_approximate(record: SpanRecord, whole: set[tuple[int, int]]) -> bool:
    if record.kind != "prompt" or record.exact:
        return False
    start = record.kv.start_position
    return (start, start + record.kv.num_tokens) not in whole
