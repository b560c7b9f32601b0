"""Span plumbing shared by the reuse modes: slice a span, tile reused spans into a plan.

Owns only geometry (which slots a span covers, which K/V rows go with them).
What a span reuses and from where is each mode's business; running a plan is
the layerwise executor's.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import replace

from kvsplice.client.execute.layerwise_plan import LayerwisePlan, LayerwiseSpan
from kvsplice.client.execute.layerwise_result import LayerwiseResult

logger = logging.getLogger(__name__)


def is_reused(span: LayerwiseSpan) -> bool:
    """Whether any layer of `span` reads provided K/V instead of computing it."""
    return span.keys is not None and span.start_layer > 0


def computed_span(start: int, end: int, name: str = "") -> LayerwiseSpan:
    """Slots [start, end) computed from their embeddings through every layer."""
    return LayerwiseSpan(start, end, name=name)


def slice_span(span: LayerwiseSpan, start: int, end: int) -> LayerwiseSpan:
    """The slots [start, end) ⊆ [span.start, span.end) of `span`, same layers, K/V and state rows cut."""
    if not span.start <= start < end <= span.end:
        raise ValueError(
            f"[{start}, {end}) is not inside span {span.name!r} [{span.start}, {span.end})"
        )
    rows = slice(start - span.start, end - span.start)
    keys = None if span.keys is None else span.keys[:, :, rows]
    values = None if span.values is None else span.values[:, :, rows]
    hidden = None if span.hidden is None else span.hidden[rows]
    return replace(span, start=start, end=end, keys=keys, values=values, hidden=hidden)


def tile_spans(num_tokens: int, spans: Sequence[LayerwiseSpan]) -> tuple[LayerwiseSpan, ...]:
    """`spans` (ascending, non-overlapping) with computed spans filling every gap up to `num_tokens`."""
    out: list[LayerwiseSpan] = []
    cursor = 0
    for span in sorted(spans, key=lambda s: s.start):
        if span.start < cursor:
            raise ValueError(f"span {span.name!r} at {span.start} overlaps the previous one")
        if span.start > cursor:
            out.append(computed_span(cursor, span.start, "computed"))
        out.append(span)
        cursor = span.end
    if cursor > num_tokens:
        raise ValueError(f"spans end at {cursor}, past the prompt's {num_tokens} tokens")
    if cursor < num_tokens:
        out.append(computed_span(cursor, num_tokens, "computed"))
    return tuple(out)


def replace_spans(
    plan: LayerwisePlan,
    spans: Sequence[LayerwiseSpan],
    *,
    logits_slots: tuple[int, ...] | None = None,
) -> LayerwisePlan:
    """`plan` with new spans: same tokens, offset, subset rules and captures; logits as given."""
    return LayerwisePlan(
        plan.token_ids, tuple(spans), plan.position_offset, subsets=plan.subsets,
        capture_layers=plan.capture_layers,
        logits_slots=plan.logits_slots if logits_slots is None else logits_slots,
    )  # fmt: skip


def resumed_spans(
    plan: LayerwisePlan, result: LayerwiseResult, layer: int, keep_kv: Collection[str]
) -> tuple[LayerwiseSpan, ...]:
    """`plan`'s spans resumed at `layer` from `result`, a run of `plan` that captured `layer`.

    Every span that was computed at `layer` starts there again from its captured state,
    reading the K/V `result` left below it; the spans named in `keep_kv` also keep the
    K/V `result` left at and above `layer` (a subset rule may let them stand in). Spans
    that computed no layer at or above `layer` are kept as they are. Below `layer` the run
    was exact when every token was computed there, and so is the resumed plan's.
    """
    captured = result.hidden_states.get(layer)
    if captured is None:
        raise ValueError(f"the run did not capture layer {layer}")
    out = []
    for span in plan.spans:
        if span.start_layer > layer:
            out.append(span)
            continue
        keys, values = result.kv.read(span.start, span.end)
        top = keys.shape[0] if span.name in keep_kv else layer
        out.append(
            replace(
                span, start_layer=layer, keys=keys[:top], values=values[:top],
                hidden=captured.span(span.start, span.end),
            )
        )  # fmt: skip
    return tuple(out)
