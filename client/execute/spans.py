"""Span plumbing shared by the reuse modes: which spans reuse, relabel approximate reuse.

Owns only geometry and relabelling (which slots a span covers, which layers it
computes). What a span reuses and from where is each mode's business; running
a plan is the executor's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from kvsplice.client.execute.layerwise_result import LayerwiseResult
from kvsplice.client.execute.plan import CallPlan, PlanSpan

logger = logging.getLogger(__name__)


def is_reused(span: PlanSpan) -> bool:
    """Whether any layer of `span` reads provided K/V instead of computing it."""
    return span.keys is not None and span.start_layer > 0


def reuse_spans(plan: CallPlan, *, approx_start_layer: int, mode: str) -> list[PlanSpan]:
    """`plan`'s spans with every approximate reuse starting to compute at `approx_start_layer`.

    Exact reuse keeps reading every layer; approximate reuse (num_layers: full
    reuse; 0: a blend candidate) is relabelled `mode`. Names are "<mode>@<start>".
    """
    spans: list[PlanSpan] = []
    for span in plan.spans:
        source = span.source
        if source is None or source.exact:
            spans.append(span)
            continue
        spans.append(replace(
            span, start_layer=approx_start_layer, source=replace(source, mode=mode),
            name=f"{mode}@{span.start}",
        ))  # fmt: skip
    return spans


def replace_spans(
    plan: CallPlan,
    spans: Sequence[PlanSpan],
    *,
    logits_slots: tuple[int, ...] | None = None,
) -> CallPlan:
    """`plan` with new spans: same tokens, offset, subset rules and captures; logits as given."""
    return CallPlan(
        plan.token_ids, tuple(spans), plan.position_offset, subsets=plan.subsets,
        capture_layers=plan.capture_layers,
        logits_slots=plan.logits_slots if logits_slots is None else logits_slots,
    )  # fmt: skip


def resumed_spans(
    plan: CallPlan, result: LayerwiseResult, layer: int, *, keep_sources: bool, exact_until: int = 0
) -> tuple[PlanSpan, ...]:
    """`plan`'s spans resumed at `layer` from `result`, a run of `plan` that captured `layer`.

    Every span that was computed at `layer` starts there again from its captured state,
    reading the K/V `result` left below it (in place: Δ 0). With `keep_sources`, the
    spans with a source (reused ones) also keep the K/V `result` left at and above
    `layer`, which a subset rule may let stand in, and their source, marked resumed;
    otherwise they are computed on from `layer` like the rest. Spans that computed no
    layer at or above `layer` are kept as they are, and so are those ending at or before
    `exact_until`, read at every layer from `result` (not reused: computed by it), when
    `result` computed them exactly through every layer (nothing approximate before them).
    Below `layer` the run was exact when every token was computed there, and so is the
    resumed plan's.
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
        if span.end <= exact_until and span.source is None:
            done = len(keys)  # every layer of it is exact already: nothing to compute
            out.append(replace(span, start_layer=done, keys=keys, values=values, delta=0))
            continue
        keep = keep_sources and span.source is not None
        top = keys.shape[0] if keep else layer
        source = replace(span.source, resumed=True) if keep and span.source else None
        out.append(
            replace(
                span, start_layer=layer, keys=keys[:top], values=values[:top], delta=0,
                hidden=captured.span(span.start, span.end), source=source,
            )
        )  # fmt: skip
    return tuple(out)
