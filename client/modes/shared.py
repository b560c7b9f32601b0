"""What several reuse modes build their plans from; no mode owns it and it imports none.

Owns the exact prefix walk (`plan_exact_prefix`), the two ways of finding K/V captured
in another context (`question_base`, `same_tokens_segment`), the position-only plan
built from them (`plan_position_only`: naive's plan, which blend and halo repair),
CacheBlend's selective-recompute rule (`blend_rule`, `blend_plan`) and the span
plumbing of approximate plans (`reuse_spans`, `replace_spans`, `resumed_spans`: which
layers a span computes, relabelling). Each mode's own rules stay in its module;
`scripts/check_layers.py` forbids a mode importing another.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from kvsplice.client.execute.execution import timed
from kvsplice.client.execute.layerwise_executor import LayerwiseResult
from kvsplice.client.execute.plan import (
    CallPlan,
    KVPair,
    PlanSpan,
    SubsetRule,
    segment_span,
    tile_spans,
)
from kvsplice.client.model.hf_cache import full_length_cache, read_layers
from kvsplice.client.modes.base import (
    CallContext,
    PlanBuilder,
    PlannedCall,
    SpannedPrompt,
    StoreContext,
    span_role,
)
from kvsplice.client.tiers.local_tier import on_device
from kvsplice.client.tiers.segment_io import SpanRecord, fetch_segment, left_tail
from kvsplice.common.keys import context_key, continues, root_key
from kvsplice.common.reuse_modes import EXACT
from kvsplice.common.segment import SegmentKind, SegmentMeta
from kvsplice.kvmath.payload import KVSource
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.storeclient.results import SegmentRef

logger = logging.getLogger(__name__)


Deviation = Literal["value", "key"]
DEVIATIONS: tuple[Deviation, ...] = ("value", "key")
# where a position-only plan takes a question's K/V: its standalone prefill, or a prompt's
QUESTION_SOURCES = ("base", "context")
# where it takes an earlier agent's answer: any stored segment with its tokens, or a prompt's
ANSWER_SOURCES = ("any", "context")


def plan_exact_prefix(prompt: SpannedPrompt, ctx: CallContext, builder: PlanBuilder) -> bytes:
    """Add the stored run matching the prompt from position 0 to `builder`.

    The sidecar's index says which segments exist; each is taken from the
    worker's local tier when held there (no fetch), else fetched and then kept
    locally; either way the splice writes it into the cache (`decode_into`). Past the end of the sidecar's run, only this worker's
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
            position, kv, EXACT, exact=True, chain_key=meta.context_key,
            chain_num_tokens=meta.num_tokens, name=f"prefix@{position}",
            decoded=meta.kind == "response",
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
) -> tuple[SegmentMeta, KVSource] | None:
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
    return _fetch_link(ctx, ref, parent, tokens, position)


def _fetch_link(
    ctx: StoreContext, ref: SegmentRef, parent: bytes, tokens: tuple[int, ...], position: int
) -> tuple[SegmentMeta, KVSource] | None:
    fetched = fetch_segment(
        ctx.store, ref.context_key, fingerprint=ctx.fingerprint, timings=ctx.timings
    )
    if fetched is None or not continues(fetched.meta, parent, tokens, position):
        return None
    kv = on_device(fetched.kv, ctx.local.device)
    ctx.local.put(fetched.meta, kv)
    return fetched.meta, kv


def plan_position_only(
    prompt: SpannedPrompt,
    ctx: CallContext,
    mode: str,
    question: str = "base",
    answers: str = "any",
    prefix: bool = False,
) -> PlannedCall[None]:
    """The exact prefix, then each later span's K/V captured in another context, Δ-shifted.

    A question takes its standalone base (`question_base`), or with `question="context"`
    a stored prompt segment with its tokens (as another prompt computed it, after that
    prompt's own beginning); an earlier agent's answer any stored segment with its tokens
    (the K/V captured while it was generated, or a prompt that quoted it), or with
    `answers="context"` only a prompt segment; any other span a stored segment with the
    same tokens (`same_tokens_segment`); a span without one is computed, and with `prefix`
    so is everything after it (only the unbroken run of sources from the start is reused).
    With both `context` and `prefix`, the reused K/V is what an engine's KV connector can
    load: spans computed inside other prompts, as one run from the prompt's start. The
    reused spans are labelled `mode`; the computed bases are the records.
    """
    builder = PlanBuilder(prompt.token_ids)
    plan_exact_prefix(prompt, ctx, builder)
    bases: list[SpanRecord] = []
    for span in prompt.spans:
        if span.start < builder.covered_until:
            if prefix and span.end > builder.covered_until:
                break  # straddling the exact prefix's end: computed, and the rest after it
            continue  # inside the exact prefix, or straddling its end: computed
        if span.start == len(prompt.token_ids) - 1:
            break  # the prompt's last token alone: always computed, so nothing to look up
        tokens = prompt.token_ids[span.start : span.end]
        role = span_role(span)
        if role == "question" and question == "context":
            kv = same_tokens_segment(tokens, prompt, span.start, ctx, kinds=("prompt",))
        elif role == "question":
            kv = question_base(tokens, ctx, bases)
        elif role == "agent_output" and answers == "context":
            kv = same_tokens_segment(tokens, prompt, span.start, ctx, kinds=("prompt",))
        else:
            kv = same_tokens_segment(tokens, prompt, span.start, ctx)
        if kv is None:
            if prefix:
                break  # computed, and with it everything after it
            continue
        builder.reuse(span.start, kv, mode, exact=False, name=span.name)
    return PlannedCall(builder.build(), records=tuple(bases))


def question_base(
    tokens: tuple[int, ...],
    ctx: CallContext,
    bases: list[SpanRecord],
    lead: tuple[int, ...] = (),
) -> KVSource | None:
    """The question's K/V prefilled alone after `lead` (none: at position 0): fetched, or
    computed and its record appended to `bases` (to put after the first token).

    Its key is the chained key of the question after `lead` from the root, which
    is exactly what that prefill computes; keys sit at positions len(lead)…
    Without a reachable store there is no base: the span is computed densely.
    """
    if not isinstance(ctx, StoreContext):
        return None
    num_degraded = ctx.store.counters.num_degraded_calls
    parent = context_key(root_key(ctx.fingerprint), lead) if lead else root_key(ctx.fingerprint)
    fetched = fetch_segment(
        ctx.store, context_key(parent, tokens), fingerprint=ctx.fingerprint, timings=ctx.timings
    )
    if fetched is not None and fetched.meta.token_ids == tokens:
        return fetched.kv
    if ctx.store.counters.num_degraded_calls > num_degraded:
        return None  # unreachable store: a base nobody else can read would only cost a prefill
    with timed(ctx.timings, "base_prefill_s"):
        cache = full_length_cache()
        ctx.executor.forward((*lead, *tokens), 0, cache)
        keys, values = read_layers(cache, len(lead), len(lead) + len(tokens))
    kv = SegmentKV(keys, values, start_position=len(lead))
    record = SpanRecord(kv, tokens, parent, lead, ctx.decode_text(tokens), "base", exact=True)
    bases.append(record)
    return kv


def same_tokens_segment(
    tokens: tuple[int, ...],
    prompt: SpannedPrompt,
    start: int,
    ctx: CallContext,
    kinds: tuple[SegmentKind, ...] | None = None,
) -> KVSource | None:
    """Any stored segment with exactly `tokens`, wherever it was captured (best ranked
    first); `kinds`: only segments of those kinds (`prompt`: computed inside a prompt)."""
    if not isinstance(ctx, StoreContext):
        return None
    with timed(ctx.timings, "lookup_s"):
        candidates = ctx.store.find_similar(
            ctx.fingerprint, tokens, left_context_ids=left_tail(prompt.token_ids, start)
        )
    for candidate in candidates:
        if not candidate.exact_tokens:
            continue
        fetched = fetch_segment(
            ctx.store, candidate.segment.context_key, fingerprint=ctx.fingerprint,
            timings=ctx.timings,
        )  # fmt: skip
        if fetched is None or fetched.meta.token_ids != tokens:
            continue
        if kinds is None or fetched.meta.kind in kinds:
            return fetched.kv
    return None


def num_selected(num_candidates: int, ratio: float) -> int:
    """floor(M·r) (CacheBlend's `int(total · ratio)`), robust to fp error in M·r."""
    return min(num_candidates, math.floor(num_candidates * ratio + 1e-9))


def token_deviation(new_kv: KVPair, old_kv: KVPair, deviation: Deviation) -> torch.Tensor:
    """[M] fp32: Σ over heads and channels of (new − old)² of keys or values [H_kv, M, D]."""
    index = 0 if deviation == "key" else 1
    diff = new_kv[index].float() - old_kv[index].float()
    return diff.square().sum(dim=(0, 2))


@dataclass(frozen=True)
class DeviationSelector:
    """A `TokenSelector`: the top floor(M·r) candidates by deviation, ascending indices."""

    ratio: float
    deviation: Deviation = "value"

    def __call__(self, layer_idx: int, new_kv: KVPair, old_kv: KVPair) -> torch.Tensor:
        scores = token_deviation(new_kv, old_kv, self.deviation)
        count = num_selected(int(scores.numel()), self.ratio)
        return torch.topk(scores, count, sorted=False).indices.sort().values


def blend_rule(check_layer: int, ratio: float, deviation: Deviation = "value") -> SubsetRule:
    """At `check_layer`, keep computing the top `ratio` share of reused tokens by deviation."""
    return SubsetRule(check_layer, DeviationSelector(ratio, deviation))


def blend_plan(
    token_ids: Sequence[int],
    chunks: Sequence[tuple[int, SegmentKV]],
    rule: SubsetRule,
    *,
    position_offset: int = 0,
) -> CallPlan:
    """Reuse each (start slot, segment) chunk CacheBlend-style under `rule`; other tokens
    computed.

    Chunks need K/V for every layer (their old K/V stand in for dropped tokens)
    and are computed from their embeddings, so layers ≤ check layer see true
    states (CacheBlend recomputes layer 0 fully). r = 1 is dense; r = 0 reuses
    the chunks' K/V of layers ≥ check layer (naive reuse for check layer ≤ 1,
    layer 0 K/V being context-free).
    """
    spans = [
        segment_span(segment, start, start_layer=0, position_offset=position_offset,
                     name=f"blend@{start}")
        for start, segment in chunks
    ]  # fmt: skip
    ids = tuple(int(t) for t in token_ids)
    return CallPlan(ids, tile_spans(len(ids), spans), position_offset, subsets=(rule,))


def is_reused(span: PlanSpan) -> bool:
    """Whether any layer of `span` reads provided K/V instead of computing it."""
    return span.kv is not None and span.start_layer > 0


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
        kv = result.kv.to_segment(span.start, span.end)  # in place: Δ 0
        if span.end <= exact_until and span.source is None:
            done = kv.num_layers  # every layer of it is exact already: nothing to compute
            out.append(replace(span, start_layer=done, kv=kv, delta=0))
            continue
        keep = keep_sources and span.source is not None
        top = kv.num_layers if keep else layer
        source = replace(span.source, resumed=True) if keep and span.source else None
        below = SegmentKV(kv.keys[:top], kv.values[:top], kv.start_position)
        out.append(
            replace(
                span, start_layer=layer, kv=below, delta=0,
                hidden=captured.span(span.start, span.end), source=source,
            )
        )  # fmt: skip
    return tuple(out)


def first_token_margin(logits: torch.Tensor) -> float:
    """Top-1 minus top-2 of a [V] logit vector (inf for a one-entry vocabulary)."""
    if logits.numel() < 2:
        return math.inf
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def declared_choices(prompt: SpannedPrompt) -> tuple[int, ...]:
    """The tokens a prompt says its answer is read from (`prompt.choice_ids`, optional on
    the protocol: a judge's candidate labels); empty when it declares none."""
    choices = getattr(prompt, "choice_ids", ())
    return tuple(int(t) for t in choices) if choices else ()


def decision_margin(logits: torch.Tensor, choices: Sequence[int]) -> float:
    """The first token's margin over the declared choices (what the caller's constrained
    read compares), else over the whole vocabulary."""
    if not choices:
        return first_token_margin(logits)
    return first_token_margin(logits[list(choices)])
