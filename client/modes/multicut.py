"""Multicut reuse (seed 003, regime B): the depth-aware guard W_exact(l) and the cut's span.

Owns `ExactWindow` (a calibratable, monotone non-decreasing table of how many
left-context tokens must match exactly before K/V of layers < l may be reused),
`choose_cut` (the deepest stored cut that passes) and `multicut_span` (reuse
layers < cut, recompute layers ≥ cut from the stored boundary state h_cut with
true attention to the new context). Finding segments and their cuts is the
policy's job; measuring calibration points is eval's.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvsplice.client.layerwise import LayerwisePlan, LayerwiseSpan, segment_span
from kvsplice.client.modes.spans import tile_spans
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

FULL: Literal["full"] = "full"
Window = int | Literal["full"]


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
    rope: RopeSpec,
    cut: int,
    *,
    num_layers: int,
    position_offset: int = 0,
    name: str = "multicut",
) -> LayerwiseSpan:
    """Slots [start, start + T): K/V of layers < cut reused (Δ-shifted), layers ≥ cut computed.

    The computed layers start from `segment.boundary_states[cut]` (h_cut, the
    residual stream entering layer `cut` where the segment was captured) and
    attend to the new context. cut 0: a computed span; cut == num_layers: full reuse.
    """
    if not 0 <= cut <= num_layers:
        raise ValueError(f"cut {cut} outside [0, {num_layers}]")
    if cut == 0:
        return LayerwiseSpan(start, start + segment.num_tokens, name=name)
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
        below, start, rope, start_layer=cut, position_offset=position_offset, name=name
    )


def multicut_plan(
    token_ids: Sequence[int],
    placed: Sequence[tuple[int, SegmentKV, int]],
    rope: RopeSpec,
    *,
    num_layers: int,
    position_offset: int = 0,
) -> LayerwisePlan:
    """A plan reusing each (start slot, segment, cut) of `placed`; every other token computed."""
    spans = [
        multicut_span(segment, start, rope, cut, num_layers=num_layers,
                      position_offset=position_offset, name=f"multicut@{start}")
        for start, segment, cut in placed
    ]  # fmt: skip
    ids = tuple(int(t) for t in token_ids)
    return LayerwisePlan(ids, tile_spans(len(ids), spans), position_offset)


def _rank(window: Window) -> float:
    return float("inf") if window == FULL else float(window)
