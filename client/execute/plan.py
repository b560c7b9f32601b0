"""The call plan: for each token span of a prompt, how it executes and where its K/V came from.

Owns the one plan model: `PlanSpan` (start layer, provided K/V and their Δ,
initial hidden state, and the `Source` of stored K/V), `SubsetRule`
(CacheBlend-style token selection at a check layer), `CallPlan`, and the rule
that the prompt's last token is always computed (`compute_last_token`).
Deciding a plan is a policy's job; running it the executor's. Model-dependent
checks happen in `check_fits`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from kvsplice.kvmath.payload import KVSource
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

KVPair = tuple[torch.Tensor, torch.Tensor]


class TokenSelector(Protocol):
    """Chooses which candidate tokens keep being computed after a check layer.

    new_kv: (keys, values) [H_kv, M, D] just computed for the M candidates;
    old_kv: the provided (reused) K/V of the same candidates, same shape; keys
    of both are post-RoPE at the same positions. Candidates are in ascending
    slot order. Returns indices into [0, M) (any order; duplicates ignored).
    """

    def __call__(self, layer_idx: int, new_kv: KVPair, old_kv: KVPair) -> torch.Tensor: ...


@dataclass(frozen=True)
class SubsetRule:
    """At `check_layer`, compute every active token, then keep only a selected subset.

    Candidates are active tokens whose span provides K/V for every layer from
    `check_layer` on (their old K/V can stand in), minus the logits tokens.
    Dropped candidates keep their *old* K/V at `check_layer` too (as LMCache's
    blender does: `old_k[imp] = k`), so selecting nothing reproduces reuse of the
    old K/V from `check_layer` on, and selecting everything reproduces dense.
    """

    check_layer: int
    select: TokenSelector

    def __post_init__(self) -> None:
        if self.check_layer < 0:
            raise ValueError(f"check_layer {self.check_layer} must be >= 0")


@dataclass(frozen=True)
class Source:
    """Where a span's provided K/V came from: a stored segment, chosen by a mode's rule.

    `mode` names the rule ("exact", "naive", ...); `exact` says whether the
    segment's whole left context equals the prompt's (then the result equals
    dense prefill up to summation order). `origin` is the slot of the segment's
    first token (a mode may cut the span later: halo) and `delta` its Δ = new −
    stored position. `chain_key` is the stored segment's context key when it is
    exact, and `chain_num_tokens` how many prompt tokens that key covers from
    `origin` (more than the span's when the last token was cut off to be
    computed); recording uses them to continue the key chain. `resumed`: the span's
    layers below its start layer were computed by an earlier pass of the same call (a
    staged mode resuming from that pass's exact states), so only what a subset rule
    dropped counts as reused. `decoded`: the segment holds K/V a decode step computed
    (a stored response), which a prefill of the same tokens computes in other kernels
    (bit-identical only up to rounding).
    """

    mode: str
    exact: bool
    origin: int
    delta: int = 0
    chain_key: bytes | None = None
    chain_num_tokens: int = 0
    resumed: bool = False
    decoded: bool = False


@dataclass(frozen=True, eq=False)
class PlanSpan:
    """Tokens [start, end): layers < start_layer read `kv`, layers >= it are computed.

    kv: K/V [L_kv, H_kv, T, D] of layers [0, L_kv), as tensors or in stored form
    (`KVSource`: the executor writes either into its cache in one pass); keys post-RoPE
    at positions `delta` before the span's target positions (`position_offset + start
    ..`): the executor rotates them by Δ = `delta` (0: already in place).
    L_kv >= start_layer. Layers in [start_layer, L_kv) are pre-filled too and
    then overwritten by computation (a subset rule may keep them). hidden:
    [T, hidden], the residual stream entering `start_layer` (None: the token
    embeddings, start_layer 0). start_layer == num_layers means nothing is
    computed for the span. `source`: where provided K/V came from (None: not
    from the store, or not to be reported as reuse).
    """

    start: int
    end: int
    start_layer: int = 0
    kv: KVSource | None = None
    hidden: torch.Tensor | None = None
    name: str = ""
    delta: int = 0
    source: Source | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"span {self.name!r} [{self.start}, {self.end}) is empty or negative")
        if self.start_layer < 0:
            raise ValueError(f"span {self.name!r} start_layer {self.start_layer} < 0")
        _check_kv(self)
        if self.start_layer > self.num_kv_layers:
            raise ValueError(
                f"span {self.name!r} starts at layer {self.start_layer} "
                f"but provides K/V for {self.num_kv_layers} layers"
            )
        if self.hidden is not None and (
            self.hidden.dim() != 2 or self.hidden.shape[0] != self.num_tokens
        ):
            raise ValueError(f"span {self.name!r} hidden must be [T={self.num_tokens}, hidden]")

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def num_kv_layers(self) -> int:
        return 0 if self.kv is None else self.kv.num_layers

    @property
    def computed(self) -> bool:
        """Whether every layer of the span is computed from its embeddings."""
        return self.kv is None and self.start_layer == 0 and self.hidden is None


class NamedRange(Protocol):
    """Tokens [start, end) of a sequence, named (a plan's span, a rendered prompt's)."""

    @property
    def name(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...


def check_tiling(spans: Sequence[NamedRange], num_tokens: int) -> None:
    """`ValueError` unless `spans` tile tokens [0, `num_tokens`) in order, without gap or overlap
    (a call plan's spans, the spans of a rendered prompt)."""
    cursor = 0
    for span in spans:
        if span.start != cursor:
            raise ValueError(f"span {span.name!r} starts at {span.start}, expected {cursor}")
        cursor = span.end
    if cursor != num_tokens:
        raise ValueError(f"spans cover {cursor} of {num_tokens} tokens")


def _check_kv(span: PlanSpan) -> None:
    if span.kv is None:
        return
    if span.kv.layer_start != 0:
        raise ValueError(f"span {span.name!r} K/V start at layer {span.kv.layer_start}, not 0")
    if span.kv.num_tokens != span.num_tokens:
        raise ValueError(
            f"span {span.name!r} K/V hold {span.kv.num_tokens} tokens, not {span.num_tokens}"
        )


@dataclass(frozen=True, eq=False)
class CallPlan:
    """Spans tiling `token_ids` in order, at positions `position_offset + slot`.

    capture_layers: layers l in [0, L] whose entering residual stream is returned
    for the tokens computed there (l == L: the final norm's input).
    logits_slots: tokens whose logits are returned (default: the last one),
    stored sorted; each must be computed through the last layer.
    """

    token_ids: tuple[int, ...]
    spans: tuple[PlanSpan, ...]
    position_offset: int = 0
    subsets: tuple[SubsetRule, ...] = ()
    capture_layers: tuple[int, ...] = ()
    logits_slots: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a plan needs at least one prompt token")
        if self.position_offset < 0:
            raise ValueError(f"position_offset {self.position_offset} < 0")
        check_tiling(self.spans, len(self.token_ids))
        # Sorted and distinct, so result rows follow slot order.
        slots = tuple(sorted(set(self.logits_slots))) or (len(self.token_ids) - 1,)
        object.__setattr__(self, "logits_slots", slots)
        if not all(0 <= s < len(self.token_ids) for s in self.logits_slots):
            raise ValueError(f"logits_slots {self.logits_slots} outside the prompt")
        if len({r.check_layer for r in self.subsets}) != len(self.subsets):
            raise ValueError("at most one subset rule per check layer")

    @classmethod
    def tiled(
        cls,
        token_ids: Sequence[int],
        spans: Sequence[PlanSpan],
        *,
        capture_layers: tuple[int, ...] = (),
    ) -> CallPlan:
        """`spans` (ascending, non-overlapping) with gaps computed and the last token computed."""
        ids = tuple(int(t) for t in token_ids)
        tiled = compute_last_token(tile_spans(len(ids), spans))
        return cls(ids, tuple(tiled), capture_layers=capture_layers)

    @classmethod
    def all_compute(
        cls,
        token_ids: Sequence[int],
        *,
        position_offset: int = 0,
        capture_layers: tuple[int, ...] = (),
        logits_slots: tuple[int, ...] = (),
    ) -> CallPlan:
        """Every token computed from its embedding through every layer (dense prefill)."""
        ids = tuple(int(t) for t in token_ids)
        span = PlanSpan(0, len(ids), name="prompt")
        return cls(
            ids, (span,), position_offset,
            capture_layers=capture_layers, logits_slots=logits_slots,
        )  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def span_of(self, slot: int) -> PlanSpan:
        return next(s for s in self.spans if s.start <= slot < s.end)


def check_fits(plan: CallPlan, num_layers: int, kv_shape: tuple[int, int]) -> None:
    """ValueError unless `plan` can run on a model with `num_layers` and (H_kv, D) = kv_shape.

    NOTE: a plan that passes fills every slot at every layer before that layer's
    attention reads it (provided K/V below a span's start layer, computed K/V
    from it on, old K/V for tokens a subset rule drops, which need all layers),
    so the mask only has to encode position causality and windows.
    """
    for span in plan.spans:
        _check_span_fits(span, num_layers, kv_shape)
    for slot in plan.logits_slots:
        if plan.span_of(slot).start_layer >= num_layers:
            raise ValueError(f"logits slot {slot} is in a span that computes no layer")
    for rule in plan.subsets:
        if rule.check_layer >= num_layers:
            raise ValueError(f"check_layer {rule.check_layer} >= num_layers {num_layers}")
    if not all(0 <= layer <= num_layers for layer in plan.capture_layers):
        raise ValueError(f"capture_layers {plan.capture_layers} outside [0, {num_layers}]")


def _check_span_fits(span: PlanSpan, num_layers: int, kv_shape: tuple[int, int]) -> None:
    if span.start_layer > num_layers or span.num_kv_layers > num_layers:
        raise ValueError(
            f"span {span.name!r} start_layer {span.start_layer} / {span.num_kv_layers} K/V "
            f"layers exceed the model's {num_layers}"
        )
    if span.kv is not None and span.kv.kv_shape[1::2] != kv_shape:
        raise ValueError(
            f"span {span.name!r} K/V heads and head_dim {span.kv.kv_shape[1::2]} != {kv_shape}"
        )
    if 0 < span.start_layer < num_layers and span.hidden is None:
        raise ValueError(
            f"span {span.name!r} starts at layer {span.start_layer} without a hidden state"
        )


def segment_span(
    segment: SegmentKV,
    start: int,
    *,
    start_layer: int,
    position_offset: int = 0,
    name: str = "",
    source: Source | None = None,
) -> PlanSpan:
    """A span at slots [start, start + T) fed from a stored segment.

    Its keys stay as stored, with Δ = position_offset + start − segment.start_position
    for the executor to rotate them by (Δ = 0 is a bit-exact copy). The hidden state
    is the segment's boundary state at `start_layer` when it stored one.
    """
    if segment.layer_start != 0:
        raise ValueError(
            f"segment starts at layer {segment.layer_start}; a span needs layers from 0"
        )
    delta = position_offset + start - segment.start_position
    return PlanSpan(
        start, start + segment.num_tokens, start_layer, segment,
        segment.boundary_states.get(start_layer), name, delta, source,
    )  # fmt: skip


def computed_span(start: int, end: int, name: str = "") -> PlanSpan:
    """Slots [start, end) computed from their embeddings through every layer."""
    return PlanSpan(start, end, name=name)


def slice_span(span: PlanSpan, start: int, end: int) -> PlanSpan:
    """The slots [start, end) ⊆ [span.start, span.end) of `span`, same layers, K/V and state rows cut."""
    if not span.start <= start < end <= span.end:
        raise ValueError(
            f"[{start}, {end}) is not inside span {span.name!r} [{span.start}, {span.end})"
        )
    first, last = start - span.start, end - span.start
    kv = None if span.kv is None else span.kv.tokens(first, last)
    hidden = None if span.hidden is None else span.hidden[first:last]
    return replace(span, start=start, end=end, kv=kv, hidden=hidden)


def tile_spans(num_tokens: int, spans: Sequence[PlanSpan]) -> tuple[PlanSpan, ...]:
    """`spans` (ascending, non-overlapping) with computed spans filling every gap up to `num_tokens`."""
    out: list[PlanSpan] = []
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


def compute_last_token(spans: Sequence[PlanSpan]) -> list[PlanSpan]:
    """`spans` with the prompt's last token computed through every layer.

    NOTE: the one place of this rule: the first generated token's distribution
    must come from a computed token attending to whatever the plan provides. A
    reused span that reaches the last token gives it up (keeping its source, so
    its key chain still counts every token the stored segment covers).
    """
    *head, last = spans
    if last.kv is None:
        return list(spans)
    kept = [slice_span(last, last.start, last.end - 1)] if last.num_tokens > 1 else []
    return [*head, *kept, computed_span(last.end - 1, last.end, f"{last.name}:last")]
