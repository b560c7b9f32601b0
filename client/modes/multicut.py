"""Mode `multicut` (seed 003, regime B): reuse a stored span's lower layers, recompute the rest.

Plan: the exact prefix, then per prompt span a stored segment with the same
tokens (`find_similar`) that was computed on its true left context (label
exact=1) and holds boundary states; the deepest cut whose W_exact(cut) window
of left context matches (`choose_cut`) gives K/V of layers < cut reused and
layers ≥ cut computed from h_cut. Storing: each segment this mode puts carries
boundary states at its cut layers (prompt pieces from the prefill's capture,
the response from one extra pass after the first token).

Also owns `ExactWindow` (a calibratable, monotone non-decreasing table of how many
left-context tokens must match exactly before K/V of layers < l may be reused),
`choose_cut` (the deepest stored cut that passes) and `multicut_span` (reuse
layers < cut, recompute layers ≥ cut from the stored boundary state h_cut with
true attention to the new context). Measuring calibration points is eval's.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from kvsplice.client.execute.execution import ExecutionState, timed
from kvsplice.client.execute.layerwise_executor import CapturedStates
from kvsplice.client.execute.plan import CallPlan, PlanSpan, Source, segment_span, tile_spans
from kvsplice.client.modes.base import (
    CallContext,
    ModeSpec,
    PlanBuilder,
    PlannedCall,
    PromptSpan,
    SpannedPrompt,
    StoreContext,
)
from kvsplice.client.modes.params import check_ranges, knob
from kvsplice.client.modes.recorder import RecordingPolicy, put_records
from kvsplice.client.modes.shared import plan_exact_prefix
from kvsplice.client.tiers.segment_io import FetchedSegment, SpanRecord, fetch_segment, left_tail
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.storeclient.results import SimilarCandidate

logger = logging.getLogger(__name__)

FULL: Literal["full"] = "full"
Window = int | Literal["full"]
# Conservative until calibrated: a cut at layer l needs a longer exact left
# window the deeper it is (seed 003's example guard: W(0)=128 … W(16)=full);
# past the last point, only an identical left context admits reuse.
DEFAULT_W_EXACT: tuple[tuple[int, Window], ...] = ((4, 8), (8, 32), (12, 128))


@dataclass(frozen=True)
class ExactWindow:
    """W_exact(l) from points ((layer, window), ...): window is a token count or "full".

    Between points the next point at or above l applies (the conservative
    step: a deeper cut never needs less); past the last point, "full" (no
    calibration says otherwise, so only an identical left context is safe).
    "full" means the whole left context, and exceeds every count.
    """

    points: tuple[tuple[int, Window], ...]

    def __post_init__(self) -> None:
        points = tuple(sorted(self.points, key=lambda point: point[0]))
        if not points:
            raise ValueError("W_exact needs at least one (layer, window) point")
        for layer, window in points:
            if layer < 0 or not (window == FULL or (isinstance(window, int) and window >= 0)):
                raise ValueError(f"W_exact point ({layer}, {window!r}) is invalid")
        layers = [layer for layer, _ in points]
        if len(set(layers)) != len(layers):
            raise ValueError(f"W_exact has two windows for one layer: {points}")
        for (l0, w0), (l1, w1) in itertools.pairwise(points):
            if _rank(w1) < _rank(w0):
                raise ValueError(f"W_exact must not decrease: W({l0})={w0!r} > W({l1})={w1!r}")
        object.__setattr__(self, "points", points)

    def __call__(self, layer: int) -> Window:
        """W_exact(layer)."""
        if layer < 0:
            raise ValueError(f"layer {layer} < 0")
        return next((window for at, window in self.points if at >= layer), FULL)

    def required(self, layer: int, left_context_len: int) -> int:
        """Tokens just left of the segment that must match for a cut at `layer` (≤ the context)."""
        window = self(layer)
        return left_context_len if window == FULL else min(int(window), left_context_len)


def choose_cut(
    stored_cuts: Sequence[int],
    exact_window: int,
    left_context_len: int,
    w_exact: ExactWindow,
) -> int | None:
    """The deepest stored cut l with W_exact(l) ≤ exact_window; None if none passes.

    exact_window: how many tokens immediately left of the segment equal the
    stored segment's left context (pass `left_context_len` only when the whole
    left context is identical, e.g. by its chained context key). Cut 0 means
    recompute every layer (dense for the span, always safe); cut L = full reuse.
    """
    if not 0 <= exact_window <= left_context_len:
        raise ValueError(f"exact_window {exact_window} outside [0, {left_context_len}]")
    passing = [c for c in stored_cuts if w_exact.required(c, left_context_len) <= exact_window]
    return max(passing) if passing else None


def common_suffix_len(stored_left_ids: Sequence[int], left_ids: Sequence[int]) -> int:
    """How many trailing tokens two left contexts share (a lower bound on the exact window)."""
    count = 0
    for a, b in zip(reversed(stored_left_ids), reversed(left_ids), strict=False):
        if a != b:
            break
        count += 1
    return count


def multicut_span(
    segment: SegmentKV,
    start: int,
    cut: int,
    *,
    num_layers: int,
    position_offset: int = 0,
    name: str = "multicut",
    source: Source | None = None,
) -> PlanSpan:
    """Slots [start, start + T): K/V of layers < cut reused (Δ-shifted), layers ≥ cut computed.

    The computed layers start from `segment.boundary_states[cut]` (h_cut, the
    residual stream entering layer `cut` where the segment was captured) and
    attend to the new context. cut 0: a computed span; cut == num_layers: full reuse.
    """
    if not 0 <= cut <= num_layers:
        raise ValueError(f"cut {cut} outside [0, {num_layers}]")
    if cut == 0:
        return PlanSpan(start, start + segment.num_tokens, name=name)
    if cut < num_layers and cut not in segment.boundary_states:
        raise ValueError(f"segment has no boundary state at cut {cut}")
    if segment.num_layers < cut or segment.layer_start != 0:
        raise ValueError(
            f"segment holds K/V of layers [{segment.layer_start}, {segment.layer_end}), "
            f"cut {cut} needs [0, {cut})"
        )
    # Only layers < cut are read; shifting the rest would be wasted work.
    below = SegmentKV(
        segment.keys[:cut], segment.values[:cut], segment.start_position,
        boundary_states={cut: segment.boundary_states[cut]} if cut < num_layers else {},
    )  # fmt: skip
    return segment_span(
        below, start, start_layer=cut, position_offset=position_offset, name=name, source=source
    )


def multicut_plan(
    token_ids: Sequence[int],
    placed: Sequence[tuple[int, SegmentKV, int]],
    *,
    num_layers: int,
    position_offset: int = 0,
) -> CallPlan:
    """A plan reusing each (start slot, segment, cut) of `placed`; every other token computed."""
    spans = [
        multicut_span(segment, start, cut, num_layers=num_layers,
                      position_offset=position_offset, name=f"multicut@{start}")
        for start, segment, cut in placed
    ]  # fmt: skip
    ids = tuple(int(t) for t in token_ids)
    return CallPlan(ids, tile_spans(len(ids), spans), position_offset)


def _rank(window: Window) -> float:
    return float("inf") if window == FULL else float(window)


MODE = "multicut"


class MulticutPolicy(RecordingPolicy):
    mode = MODE

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or Params()
        self.w_exact = self.params.window()

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[None]:
        builder = PlanBuilder(prompt.token_ids)
        plan_exact_prefix(prompt, ctx, builder)
        exact = builder.build()
        if not isinstance(ctx, StoreContext):
            return PlannedCall(exact)  # nothing to find and nowhere to store boundary states
        num_layers = ctx.executor.num_layers
        reused = [s for s in exact.spans if s.kv is not None]
        for span in prompt.spans:
            if span.start < builder.covered_until:
                continue
            placed = self._place(span, prompt, ctx, num_layers)
            if placed is not None:
                reused.append(placed)
        cuts = self.params.cut_layers(num_layers)
        return PlannedCall(CallPlan.tiled(prompt.token_ids, reused, capture_layers=cuts))

    def store_records(
        self, ctx: StoreContext, prompt: SpannedPrompt, run: ExecutionState, batch: list[SpanRecord]
    ) -> None:
        """Put this call's segments with boundary states at every cut layer (the writer takes
        them when the run captured none)."""
        captured = run.layerwise.hidden_states if run.layerwise else None
        if captured is None:
            super().store_records(ctx, prompt, run, batch)
            return
        exact_responses = [r.token_ids for r in batch if _exact_kind(r) == "response"]
        response = self._response_states(run, ctx, exact_responses[0]) if exact_responses else {}
        put_records(ctx, [_with_states(r, captured, response) for r in batch])

    def _place(
        self, span: PromptSpan, prompt: SpannedPrompt, ctx: StoreContext, num_layers: int
    ) -> PlanSpan | None:
        """A multicut span for `span` (its source the stored segment it reads), or None."""
        tokens = prompt.token_ids[span.start : span.end]
        with timed(ctx.timings, "lookup_s"):
            candidates = ctx.store.find_similar(
                ctx.fingerprint, tokens, left_context_ids=left_tail(prompt.token_ids, span.start)
            )
        exact_tokens = [c for c in candidates if c.exact_tokens][: self.params.max_candidates]
        for candidate in exact_tokens:
            fetched = fetch_segment(
                ctx.store, candidate.segment.context_key, fingerprint=ctx.fingerprint,
                timings=ctx.timings,
            )  # fmt: skip
            cut = self._cut(fetched, candidate, tokens, span.start, num_layers)
            if fetched is not None and cut is not None:
                delta = span.start - fetched.kv.start_position
                with timed(ctx.timings, "decode_s"):
                    segment = fetched.kv.decode(ctx.decode_dtype)  # boundary states too
                return multicut_span(
                    segment, span.start, cut, num_layers=num_layers, name=f"{MODE}@{span.start}",
                    source=Source(MODE, False, span.start, delta),
                )  # fmt: skip
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
        if not meta.exact or kv.layer_start or kv.num_layers != num_layers:
            return None
        window = start if candidate.same_left_context else min(candidate.exact_window, start)
        # "full" means the whole left context is identical, which a window as long as
        # ours only proves when the stored segment also sat at our position.
        identical = window == start and meta.start_position == start
        stored = [c for c in kv.boundary_states if 0 < c < num_layers] + [num_layers]
        if not identical:
            stored = [c for c in stored if self.w_exact(c) != FULL]
        cut = choose_cut(stored, window, start, self.w_exact)
        return cut or None

    def _response_states(
        self, state: ExecutionState, ctx: CallContext, response_ids: Sequence[int]
    ) -> dict[int, torch.Tensor]:
        """cut -> [R, hidden] states of the response tokens, from one pass over the call's cache."""
        if not response_ids:
            return {}
        reuse = state.reuse
        executor = ctx.executor.layerwise
        prompt_kv = ctx.executor.read_kv(state, 0, reuse.num_tokens)
        num_layers, end = executor.num_layers, reuse.num_tokens + len(response_ids)
        prompt_span = PlanSpan(0, reuse.num_tokens, num_layers, prompt_kv, name="prompt")
        spans = (prompt_span, PlanSpan(reuse.num_tokens, end, name="response"))
        cuts = self.params.cut_layers(num_layers)
        ids = reuse.token_ids + tuple(int(t) for t in response_ids)
        result = executor.run(CallPlan(ids, spans, capture_layers=cuts))
        return {c: result.hidden_states[c].span(reuse.num_tokens, end) for c in cuts}


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
    return record.kind if record.exact else None


def _rows(captured: CapturedStates, start: int, end: int) -> torch.Tensor | None:
    """States of slots [start, end) when all were computed at that layer."""
    try:
        return captured.span(start, end)
    except ValueError:
        return None


# The calibration grid of W_exact tables, from most to least left context demanded.
W_EXACT_TABLES: dict[str, tuple[tuple[int, Window], ...]] = {
    "conservative": ((4, 32), (8, 128)),
    "default": DEFAULT_W_EXACT,
    "permissive": ((4, 4), (8, 16), (16, 64), (24, 128)),
}


@dataclass(frozen=True)
class Params:
    """multicut's parameters: the W_exact table, or one cut below which no window is needed.

    `multicut:cut=16`: cuts at or below layer 16 reuse with no exact window; deeper
    ones need the whole left context (it replaces the table). cut_every: store cuts
    at layers k, 2k, … < L; max_candidates: same-token segments fetched per span
    before giving up.
    """

    w_exact: tuple[tuple[int, Window], ...] = knob(
        DEFAULT_W_EXACT, "w_exact", "the depth-aware guard: (layer, exact left tokens | full), ...",
        grid=tuple(W_EXACT_TABLES.values()), grid_labels=tuple(W_EXACT_TABLES), variant=False,
    )  # fmt: skip
    cut: int | None = knob(
        None, "cut", "layers below the cut reused with no exact window; deeper cuts need "
        "the whole left context", low=0,
    )  # fmt: skip
    cut_every: int = knob(4, "cut_every", "boundary states stored every k layers", variant=False)
    max_candidates: int = knob(
        3, "candidates", "same-token segments fetched per span before giving up", variant=False
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        object.__setattr__(self, "w_exact", ExactWindow(tuple(self.w_exact)).points)
        if self.cut_every < 1:
            raise ValueError(f"cut_every {self.cut_every} must be >= 1")
        if self.max_candidates < 1:
            raise ValueError(f"max_candidates {self.max_candidates} must be >= 1")

    def window(self) -> ExactWindow:
        """The guard: the table, or `cut`'s one point."""
        return ExactWindow(self.w_exact if self.cut is None else ((self.cut, 0),))

    def cut_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers 0 < l < L whose entering residual stream is stored."""
        return tuple(range(self.cut_every, num_layers, self.cut_every))


SPEC = ModeSpec(MODE, Params, MulticutPolicy)
