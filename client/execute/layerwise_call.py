"""An approximate mode's plan: a layerwise plan, where its provided K/V came from, and its view.

Owns `LayerwiseCall`, `SpanSource`, the conversions from a span-level `ReusePlan`
to layerwise spans, and `LayerwiseCall.view`: after the run, which prompt ranges
reused which layers, as a `ReusePlan` (for outcomes and for storing). Deciding
plans is the policies'; running them the layerwise executor's.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from kvsplice.client.execute.layerwise_plan import LayerwisePlan, LayerwiseSpan, segment_span
from kvsplice.client.execute.layerwise_result import LayerwiseResult
from kvsplice.client.execute.reuse_plan import Compute, PlannedSpan, Reuse, ReusePlan
from kvsplice.client.execute.spans import computed_span, slice_span
from kvsplice.client.store.segment_io import SpanRecord, slice_segment
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

LayerRange = tuple[int, int]


class PromptRange(Protocol):
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...


@dataclass(frozen=True, eq=False)
class SpanSource:
    """The stored K/V behind the layerwise span of the same name.

    `action.segment` keeps its own positions and layers (the span holds them
    shifted or corrected); its token 0 sits at slot `start`, which stays the
    same when a mode cuts the span (halo). `resumed`: the span's layers below its
    start layer were computed by an earlier pass of the same call (a staged mode
    resuming from that pass's exact states), so only what a subset rule dropped
    counts as reused.
    """

    start: int
    action: Reuse
    resumed: bool = False


@dataclass(frozen=True, eq=False)
class LayerwiseCall:
    """A plan for the layerwise executor; `result` set when the policy already ran it."""

    plan: LayerwisePlan
    sources: Mapping[str, SpanSource]
    result: LayerwiseResult | None = None

    def view(self, result: LayerwiseResult) -> ReusePlan:
        """The run as prompt ranges: each token reusing some layer's K/V in a `Reuse` whose
        segment holds the reused layers; tokens computed through every layer in `Compute`."""
        num_layers = result.kv.num_layers
        dropped = _dropped_at(self.plan, result)
        spans: list[PlannedSpan] = []
        for span in self.plan.spans:
            source = self.sources.get(span.name)
            resumed = source is not None and source.resumed
            for start, end, layers in _runs(span, dropped, num_layers, resumed):
                if source is None or layers is None:
                    spans.append(PlannedSpan(start, end, Compute(), span.name))
                else:
                    action = _view_action(source, start, end, layers, num_layers)
                    spans.append(PlannedSpan(start, end, action, span.name))
        return ReusePlan(self.plan.token_ids, tuple(spans))


def reuse_spans(
    plan: ReusePlan, rope: RopeSpec, num_layers: int, *, approx_start_layer: int, mode: str
) -> tuple[list[LayerwiseSpan], dict[str, SpanSource]]:
    """`plan`'s spans as layerwise spans, and the sources of the reused ones.

    Exact reuse reads every layer (start layer L); approximate reuse starts
    computing at `approx_start_layer` (L: full reuse; 0: a blend candidate)
    and is relabelled `mode`. Names are "<mode>@<start>" (unique per plan).
    """
    spans: list[LayerwiseSpan] = []
    sources: dict[str, SpanSource] = {}
    for planned in plan.spans:
        action = planned.action
        if not isinstance(action, Reuse):
            spans.append(computed_span(planned.start, planned.end, f"computed@{planned.start}"))
            continue
        exact = action.exact
        name = f"{action.mode if exact else mode}@{planned.start}"
        start_layer = num_layers if exact else approx_start_layer
        spans.append(
            segment_span(action.segment, planned.start, rope, start_layer=start_layer, name=name)
        )
        sources[name] = SpanSource(planned.start, action if exact else replace(action, mode=mode))
    return spans, sources


def compute_last_token(spans: Sequence[LayerwiseSpan]) -> list[LayerwiseSpan]:
    """`spans` with the prompt's last token computed through every layer (its logits are needed).

    NOTE: the same rule as `ReusePlan`: the first token's distribution must come
    from a computed token attending to whatever the plan provides.
    """
    *head, last = spans
    if last.keys is None:
        return list(spans)
    kept = [slice_span(last, last.start, last.end - 1)] if last.num_tokens > 1 else []
    return [*head, *kept, computed_span(last.end - 1, last.end, f"{last.name}:last")]


def whole_span_records(
    records: Sequence[SpanRecord], prompt_spans: Sequence[PromptRange]
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


def _dropped_at(plan: LayerwisePlan, result: LayerwiseResult) -> dict[int, int]:
    """slot -> the check layer whose subset rule stopped computing it (kept its old K/V)."""
    dropped: dict[int, int] = {}
    for rule in sorted(plan.subsets, key=lambda r: r.check_layer):
        kept = result.kept_slots.get(rule.check_layer)
        if kept is None:
            continue  # nothing was active there
        active = {
            slot
            for span in plan.spans
            if span.start_layer <= rule.check_layer
            for slot in range(span.start, span.end)
        }
        for slot in active - set(kept) - set(dropped):
            dropped[slot] = rule.check_layer
    return dropped


def _reused_layers(
    span: LayerwiseSpan, slot: int, dropped: Mapping[int, int], num_layers: int, resumed: bool
) -> LayerRange | None:
    """Layers whose K/V of `slot` were provided, not computed (None: computed everywhere)."""
    if span.keys is None:
        return None
    if slot in dropped and (span.start_layer == 0 or resumed):
        return dropped[slot], num_layers
    if resumed:
        return None  # its lower layers were computed by the call's earlier pass
    # A span starting above 0 and also dropped by a rule is not planned by any
    # mode but a resumed one; it would count only its lower layers here.
    return (0, span.start_layer) if span.start_layer > 0 else None


def _runs(
    span: LayerwiseSpan, dropped: Mapping[int, int], num_layers: int, resumed: bool
) -> Iterator[tuple[int, int, LayerRange | None]]:
    """Maximal runs [start, end) of `span`'s slots that reused the same layers."""
    layers = [
        _reused_layers(span, s, dropped, num_layers, resumed) for s in range(span.start, span.end)
    ]
    cursor = span.start
    for value, group in itertools.groupby(layers):
        count = len(list(group))
        yield cursor, cursor + count, value
        cursor += count


def _view_action(
    source: SpanSource, start: int, end: int, layers: LayerRange, num_layers: int
) -> Reuse:
    """The source's tokens [start, end) and reused layers; the key chain only for a whole span."""
    part = slice_segment(source.action.segment, start - source.start, end - source.start)
    first, last = layers
    segment = SegmentKV(
        part.keys[first:last], part.values[first:last], part.start_position, layer_start=first
    )
    whole = start == source.start and layers == (0, num_layers)
    return replace(
        source.action,
        segment=segment,
        chain_key=source.action.chain_key if whole else None,
        chain_num_tokens=source.action.chain_num_tokens if whole else 0,
    )
