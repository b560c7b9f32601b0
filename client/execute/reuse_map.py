"""What a run reused, per prompt range: a function of the plan and what the run kept.

Owns `ReuseMap` (ranges tiling the prompt, each computed or reusing some layers
of a stored segment) and `reuse_map`, which reads it off a `CallPlan` and the
slots its subset rules kept. Outcomes report it and the recorder continues
the key chain from it; it holds no K/V.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from kvsplice.client.execute.plan import CallPlan, PlanSpan, Source

logger = logging.getLogger(__name__)

LayerRange = tuple[int, int]


@dataclass(frozen=True)
class ReusedRange:
    """Prompt slots [start, end): computed through every layer (`source` None), or reusing
    layers `layers` = [first, last) of the stored K/V `source` describes.

    `source.chain_key` is kept only when the range is its whole stored span at every layer.
    """

    start: int
    end: int
    name: str = ""
    source: Source | None = None
    layers: LayerRange = (0, 0)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclass(frozen=True)
class ReuseMap:
    """Ranges tiling `token_ids` in order."""

    token_ids: tuple[int, ...]
    ranges: tuple[ReusedRange, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def reused(self) -> tuple[ReusedRange, ...]:
        return tuple(r for r in self.ranges if r.source is not None)

    @property
    def num_reused_tokens(self) -> int:
        return sum(r.num_tokens for r in self.reused)


def reuse_map(
    plan: CallPlan, num_layers: int, kept_slots: Mapping[int, tuple[int, ...]] | None = None
) -> ReuseMap:
    """The run of `plan` as prompt ranges; `kept_slots`: check layer -> slots its rule kept."""
    dropped = _dropped_at(plan, kept_slots or {})
    ranges: list[ReusedRange] = []
    for span in plan.spans:
        for start, end, layers in _runs(span, dropped, num_layers):
            if span.source is None or layers is None:
                ranges.append(ReusedRange(start, end, span.name))
                continue
            whole = start == span.source.origin and layers == (0, num_layers)
            source = (
                span.source if whole else replace(span.source, chain_key=None, chain_num_tokens=0)
            )
            ranges.append(ReusedRange(start, end, span.name, source, layers))
    return ReuseMap(plan.token_ids, tuple(ranges))


def _dropped_at(plan: CallPlan, kept_slots: Mapping[int, tuple[int, ...]]) -> dict[int, int]:
    """slot -> the check layer whose subset rule stopped computing it (kept its old K/V)."""
    dropped: dict[int, int] = {}
    for rule in sorted(plan.subsets, key=lambda r: r.check_layer):
        kept = kept_slots.get(rule.check_layer)
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
    span: PlanSpan, slot: int, dropped: Mapping[int, int], num_layers: int
) -> LayerRange | None:
    """Layers whose K/V of `slot` were provided, not computed (None: computed everywhere)."""
    if span.kv is None:
        return None
    resumed = span.source is not None and span.source.resumed
    if slot in dropped and (span.start_layer == 0 or resumed):
        return dropped[slot], num_layers
    if resumed:
        return None  # its lower layers were computed by the call's earlier pass
    # A span starting above 0 and also dropped by a rule is not planned by any
    # mode but a resumed one; it would count only its lower layers here.
    return (0, span.start_layer) if span.start_layer > 0 else None


def _runs(
    span: PlanSpan, dropped: Mapping[int, int], num_layers: int
) -> Iterator[tuple[int, int, LayerRange | None]]:
    """Maximal runs [start, end) of `span`'s slots that reused the same layers."""
    layers = [_reused_layers(span, s, dropped, num_layers) for s in range(span.start, span.end)]
    cursor = span.start
    for value, group in itertools.groupby(layers):
        count = len(list(group))
        yield cursor, cursor + count, value
        cursor += count
