"""Mode `multicut` (seed 003, regime B): reuse a stored span's lower layers, recompute the rest.

Plan: the exact prefix, then per prompt span a stored segment with the same
tokens (`find_similar`) that was computed on its true left context (label
exact=1) and holds boundary states; the deepest cut whose W_exact(cut) window
of left context matches (`choose_cut`) gives K/V of layers < cut reused and
layers ≥ cut computed from h_cut. Storing: each segment this mode puts carries
boundary states at its cut layers (prompt pieces from the prefill's capture,
the response from one extra pass after the first token).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from kvsplice.client.admission import DEFAULT_W_EXACT
from kvsplice.client.call_timings import timed
from kvsplice.client.layerwise import CapturedStates, LayerwisePlan, LayerwiseSpan
from kvsplice.client.modes.multicut import FULL, ExactWindow, choose_cut, multicut_span
from kvsplice.client.modes.spans import tile_spans
from kvsplice.client.policies.base import CallContext, PlanBuilder, PromptSpan, SpannedPrompt
from kvsplice.client.policies.exact import plan_exact_prefix
from kvsplice.client.policies.layerwise_call import (
    LayerwiseCall,
    SpanSource,
    compute_last_token,
    reuse_spans,
)
from kvsplice.client.policies.recorder import RecordingPolicy, call_records, put_records
from kvsplice.client.reuse_plan import Reuse, ReusePlan
from kvsplice.client.segment_io import FetchedSegment, SpanRecord, fetch_segment, left_tail
from kvsplice.client.span_executor import ExecutionState
from kvsplice.client.store_types import SimilarCandidate
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

MODE = "multicut"


@dataclass(frozen=True)
class MulticutConfig:
    """w_exact: the depth-aware guard; cut_every: store cuts at layers k, 2k, … < L.

    max_candidates: same-token segments fetched per span before giving up.
    """

    w_exact: ExactWindow = field(default_factory=lambda: ExactWindow(DEFAULT_W_EXACT))
    cut_every: int = 4
    max_candidates: int = 3

    def __post_init__(self) -> None:
        if self.cut_every < 1:
            raise ValueError(f"cut_every {self.cut_every} must be >= 1")
        if self.max_candidates < 1:
            raise ValueError(f"max_candidates {self.max_candidates} must be >= 1")

    def cut_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers 0 < l < L whose entering residual stream is stored."""
        return tuple(range(self.cut_every, num_layers, self.cut_every))


class MulticutPolicy(RecordingPolicy):
    mode = MODE

    def __init__(self, config: MulticutConfig | None = None) -> None:
        self.config = config or MulticutConfig()

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> ReusePlan | LayerwiseCall:
        builder = PlanBuilder(prompt.token_ids)
        plan_exact_prefix(prompt, ctx, builder)
        exact = builder.build()
        if ctx.store is None:
            return exact  # nothing to find and nowhere to store boundary states
        assert ctx.rope is not None and ctx.layerwise_executor is not None
        num_layers = ctx.layerwise_executor().num_layers
        spans, sources = reuse_spans(
            exact, ctx.rope, num_layers, approx_start_layer=num_layers, mode=MODE
        )
        reused = [s for s in spans if s.keys is not None]
        for span in prompt.spans:
            if span.start < builder.covered_until:
                continue
            placed = self._place(span, prompt, ctx, num_layers)
            if placed is not None:
                layerwise_span, stored = placed
                reused.append(layerwise_span)
                source = SpanSource(span.start, Reuse(stored, MODE, exact=False))
                sources[layerwise_span.name] = source
        tiled = compute_last_token(tile_spans(len(prompt.token_ids), reused))
        cuts = self.config.cut_layers(num_layers)
        plan = LayerwisePlan(prompt.token_ids, tuple(tiled), capture_layers=cuts)
        return LayerwiseCall(plan, sources)

    def after_call(
        self,
        prompt: SpannedPrompt,
        plan: ReusePlan,
        state: ExecutionState,
        ctx: CallContext,
        response_ids: Sequence[int],
    ) -> None:
        """Store this call's segments with boundary states at every cut layer."""
        captured = ctx.layerwise_result.hidden_states if ctx.layerwise_result else None
        if ctx.store is None or captured is None:
            super().after_call(prompt, plan, state, ctx, response_ids)
            return
        records = call_records(prompt, plan, state, ctx, response_ids)
        exact_response = any(_exact_kind(r) == "response" for r in records)
        response = self._response_states(plan, state, ctx, response_ids) if exact_response else {}
        put_records(ctx, [_with_states(r, captured, response) for r in records])

    def _place(
        self, span: PromptSpan, prompt: SpannedPrompt, ctx: CallContext, num_layers: int
    ) -> tuple[LayerwiseSpan, SegmentKV] | None:
        """A multicut span for `span` and the stored segment it reads, or None."""
        assert ctx.store is not None and ctx.rope is not None
        tokens = prompt.token_ids[span.start : span.end]
        with timed(ctx.timings, "lookup_s"):
            candidates = ctx.store.find_similar(
                ctx.fingerprint, tokens, left_context_ids=left_tail(prompt.token_ids, span.start)
            )
        exact_tokens = [c for c in candidates if c.exact_tokens][: self.config.max_candidates]
        for candidate in exact_tokens:
            fetched = fetch_segment(
                ctx.store, candidate.segment.segment_id, fingerprint=ctx.fingerprint,
                dtype=ctx.decode_dtype, timings=ctx.timings,
            )  # fmt: skip
            cut = self._cut(fetched, candidate, tokens, span.start, num_layers)
            if fetched is not None and cut is not None:
                with timed(ctx.timings, "shift_s"):
                    placed = multicut_span(
                        fetched.kv, span.start, ctx.rope, cut, num_layers=num_layers,
                        name=f"{MODE}@{span.start}",
                    )  # fmt: skip
                return placed, fetched.kv
        return None

    def _cut(
        self,
        fetched: FetchedSegment | None,
        candidate: SimilarCandidate,
        tokens: tuple[int, ...],
        start: int,
        num_layers: int,
    ) -> int | None:
        """The deepest admitted cut > 0 of `fetched` at slot `start`, or None."""
        if fetched is None or fetched.meta.token_ids != tokens:
            return None
        kv, meta = fetched.kv, fetched.meta
        # NOTE: the guard compares left-context *tokens*; K/V computed on top of
        # approximate reuse would carry that error, so only exact segments qualify.
        if dict(meta.labels).get("exact") != "1" or kv.layer_start or kv.num_layers != num_layers:
            return None
        window = start if candidate.same_left_context else min(candidate.exact_window, start)
        # "full" means the whole left context is identical, which a window as long as
        # ours only proves when the stored segment also sat at our position.
        identical = window == start and meta.start_position == start
        stored = [c for c in kv.boundary_states if 0 < c < num_layers] + [num_layers]
        if not identical:
            stored = [c for c in stored if self.config.w_exact(c) != FULL]
        cut = choose_cut(stored, window, start, self.config.w_exact)
        return cut or None

    def _response_states(
        self,
        plan: ReusePlan,
        state: ExecutionState,
        ctx: CallContext,
        response_ids: Sequence[int],
    ) -> dict[int, torch.Tensor]:
        """cut -> [R, hidden] states of the response tokens, from one pass over the call's cache."""
        if not response_ids:
            return {}
        assert ctx.layerwise_executor is not None
        executor = ctx.layerwise_executor()
        prompt_kv = ctx.executor.read_kv(state, 0, plan.num_tokens)
        num_layers, end = executor.num_layers, plan.num_tokens + len(response_ids)
        prompt_span = LayerwiseSpan(
            0, plan.num_tokens, num_layers, prompt_kv.keys, prompt_kv.values, name="prompt"
        )
        spans = (prompt_span, LayerwiseSpan(plan.num_tokens, end, name="response"))
        cuts = self.config.cut_layers(num_layers)
        ids = plan.token_ids + tuple(int(t) for t in response_ids)
        result = executor.run(LayerwisePlan(ids, spans, capture_layers=cuts))
        return {c: result.hidden_states[c].span(plan.num_tokens, end) for c in cuts}


def _with_states(
    record: SpanRecord,
    captured: dict[int, CapturedStates],
    response: dict[int, torch.Tensor],
) -> SpanRecord:
    """An exact `record` with boundary states at every cut its tokens were computed at.

    Approximate records get none: the guard never admits them (see `_cut`).
    """
    kv = record.kv
    start, end = kv.start_position, kv.start_position + kv.num_tokens
    kind = _exact_kind(record)
    if kind == "response":
        states = dict(response)
    elif kind == "prompt":
        states = {
            c: rows for c, s in captured.items() if (rows := _rows(s, start, end)) is not None
        }
    else:
        return record
    if not states:
        return record
    with_states = SegmentKV(kv.keys, kv.values, kv.start_position, kv.layer_start, states)
    return replace(record, kv=with_states)


def _exact_kind(record: SpanRecord) -> str | None:
    """The record's kind ("prompt", "response", "base") when its K/V are exact, else None."""
    labels = dict(record.labels)
    return labels.get("kind") if labels.get("exact") == "1" else None


def _rows(captured: CapturedStates, start: int, end: int) -> torch.Tensor | None:
    """States of slots [start, end) when all were computed at that layer."""
    try:
        return captured.span(start, end)
    except ValueError:
        return None
