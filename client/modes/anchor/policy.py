"""Mode `anchor` (KVComm): placeholders corrected from an anchor pool, or dense plus a new anchor.

Per placeholder after the exact prefix: its base K/V, the placeholder's pool decoded
with this agent's offsets, and the gate. All confident → one call
reusing each placeholder and the text after it as corrected K/V. Otherwise the
call is dense (KVComm: an agent relying on an unshareable placeholder prefills)
and, after its first token, each such placeholder joins (or becomes) an anchor
with this agent's real − base offsets.
NOTE: 641 lines, past the 600-line limit: splitting the pool decoding and the gate out by
concept is part of issue 26 (one Params per mode, modes standing alone), not done yet.

Bases, as KVComm builds them: another agent's answer (`agent_*` placeholders)
has the K/V its sender computed (the sender stores it after its call under
`sender_base_parent`), so an offset is only the change of context from sender
to receiver; a question (or tool output) is prefilled after a neutral lead
(`question_base`, paid in the TTFT of the call that computes it).

NOTE: past 600 lines since issue 14 added pooled judge anchors (PAL-KV, `pool`) on
top of the mode folded from client/modes + client/policies (issue 13). The next
split is the base handling (`_base`, sender bases, question bases, and the `bases`
they append what they compute to) into its own module of this folder.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import torch
import xxhash

from kvsplice.client.execute.call_timings import CallTimings, timed
from kvsplice.client.execute.execution import ExecutionState
from kvsplice.client.execute.plan import CallPlan, PlanSpan, Source, tile_spans
from kvsplice.client.execute.spans import replace_spans
from kvsplice.client.modes.anchor.anchors import AgentOffsets, Anchor, Metric, kv_offset
from kvsplice.client.modes.anchor.cache import AnchorKey, DecodedAnchors
from kvsplice.client.modes.anchor.codec import (
    AnchorStore,
    anchor_id_of,
    decode_anchor,
    encode_base,
    encode_offsets,
    is_agent_output,
    on_device,
    placeholder_id_of,
    sender_base_parent,
)
from kvsplice.client.modes.anchor.correction import AnchorQuery, anchor_spans, correct
from kvsplice.client.modes.anchor.gate import GateConfig, GateDecision, decide
from kvsplice.client.modes.anchor.weights import WeightConfig
from kvsplice.client.modes.base import ModeSpec, PlanBuilder, PromptSpan, SpannedPrompt
from kvsplice.client.modes.blend import BlendConfig, blend_plan
from kvsplice.client.modes.call_context import CallContext, StoreContext
from kvsplice.client.modes.exact import plan_exact_prefix
from kvsplice.client.modes.naive import question_base
from kvsplice.client.modes.params import check_ranges, knob
from kvsplice.client.modes.planned_call import PlannedCall
from kvsplice.client.modes.recorder import RecordingPolicy, call_records, put_records
from kvsplice.client.modes.risk_gate import classify
from kvsplice.client.store.segment_io import SpanRecord, fetch_segment, slice_segment
from kvsplice.client.store.store_types import AnchorEntry
from kvsplice.common.errors import ResourceExhausted
from kvsplice.common.keys import context_key
from kvsplice.kvmath.quant import QUANT_SCHEMES
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

MODE = "anchor"


@dataclass(frozen=True)
class AnchorConfig:
    """gate: γ, metric and weights (τ); quant: the anchor payloads' scheme.

    base_lead: text prefilled before each placeholder's base and dropped (KVComm
    prefills its question bases after the user header). Without it the base's
    first token is an attention sink whose K/V nothing in a real prompt
    resembles, and every offset (real − base) inherits that difference. The
    same for every agent, so one base serves all of an anchor's offsets.
    sender_bases: answers' bases are their senders' K/V (False: lead prefills).
    repair: CacheBlend on the corrected K/V (None: they are read at every layer).
    Every corrected token is computed through `repair.check_layer` and the
    `repair.ratio` share deviating most from the correction is computed above
    it: KVComm's correction as the starting point, blend's selective recompute
    for what the correction still gets wrong.

    max_anchor_nbytes: an anchor whose base plus one agent's offsets would exceed
    it is not stored (the store refuses more than its own limit, 256 MiB by default).
    decoded_cache_bytes: decoded anchors kept in the worker between calls
    (`DecodedAnchors`; 0: fetched and decoded on every call).
    min_coverage: 1.0 is KVComm's length rule (anchors at least as long as the
    placeholder); below it, a placeholder longer than all but one anchor has its
    first tokens corrected if they are at least this share (`_coverage`).
    pool_judges: PAL-KV (seed 001): when the call is judge-like (`risk_gate.classify`),
    retrieval ignores agent identity (any agent's offsets, its own first) and each
    answer placeholder retrieves from the union of the pools of all the prompt's answer
    placeholders. The gate, weights and correction stay KVComm's.
    """

    gate: GateConfig = field(default_factory=GateConfig)
    quant: str = "int8"
    base_lead: str = "<|im_start|>user\n"
    sender_bases: bool = True
    repair: BlendConfig | None = None
    max_anchor_nbytes: int = (256 << 20) - (64 << 10)
    decoded_cache_bytes: int = 256 << 20
    min_coverage: float = 1.0
    pool_judges: bool = False

    def __post_init__(self) -> None:
        if self.quant not in QUANT_SCHEMES:
            raise ValueError(f"quant {self.quant!r} not in {QUANT_SCHEMES}")
        if not 0 < self.min_coverage <= 1:
            raise ValueError(f"min_coverage {self.min_coverage} must be in (0, 1]")
        if self.decoded_cache_bytes < 0:
            raise ValueError(f"decoded_cache_bytes {self.decoded_cache_bytes} must be >= 0")
        if self.max_anchor_nbytes < 1:
            raise ValueError(f"max_anchor_nbytes {self.max_anchor_nbytes} must be >= 1")


@dataclass(frozen=True, eq=False)
class _Gated:
    """One placeholder's gate outcome; `pool`: its eligible anchors for this agent."""

    span: PromptSpan
    placeholder_id: str
    decision: GateDecision
    base: SegmentKV | None = None
    pool: tuple[Anchor, ...] = ()


@dataclass(frozen=True, eq=False)
class _Notes:
    """What `plan` leaves for `after_call`: anchors to add, activations to count."""

    agent_id: str
    to_anchor: tuple[PromptSpan, ...] = ()
    activated: tuple[tuple[str, tuple[str, ...]], ...] = ()
    pooled: tuple[str, ...] = ()  # PAL-KV: the answer pools a judge-like call retrieves from


def agent_key(prompt: SpannedPrompt) -> str:
    """The agent's offset key: a digest of its template (fixed text ids and placeholder names).

    Stable across samples (only placeholder values change) and distinct per
    agent; two agents with the same template see the same context, so sharing
    offsets between them is correct. Weights are never cached across agents.
    """
    digest = xxhash.xxh3_64()
    for span in prompt.spans:
        part = span.name if span.kind == "placeholder" else prompt.token_ids[span.start : span.end]
        digest.update(f"{span.kind}:{part};".encode())
    return f"tpl-{digest.hexdigest()}"


class AnchorPolicy(RecordingPolicy):
    mode = MODE

    def __init__(self, config: AnchorConfig | None = None) -> None:
        self.config = config or AnchorConfig()
        self._decoded = DecodedAnchors(self.config.decoded_cache_bytes)

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[_Notes]:
        builder = PlanBuilder(prompt.token_ids)
        plan_exact_prefix(prompt, ctx, builder)
        exact = builder.build()
        placeholders = [
            s for s in prompt.spans if s.kind == "placeholder" and s.start >= builder.covered_until
        ]
        if not isinstance(ctx, StoreContext) or not placeholders:
            return PlannedCall(exact)
        decisions: dict[str, str] = {}
        notes = _Notes(agent_key(prompt), pooled=self._pooled_ids(prompt, ctx, decisions))
        bases: list[SpanRecord] = []  # the bases this plan computes, put after the call
        gated: list[_Gated] = []
        for index, span in enumerate(placeholders):
            outcome = self._gate(span, prompt, ctx, notes, bases, plan_time=True)
            if outcome is None:
                decisions["anchor_gate"] = "no_base"
                # store unreachable, or the sender's answer K/V is missing
                return PlannedCall(exact, records=tuple(bases), decisions=decisions, memo=notes)
            if not outcome.decision.reuse:
                decisions["anchor_gate"] = outcome.decision.reason
                notes = replace(notes, to_anchor=tuple(placeholders[index:]))
                return PlannedCall(exact, records=tuple(bases), decisions=decisions, memo=notes)
            gated.append(outcome)
        decisions["anchor_gate"] = "confident"
        if self.config.min_coverage < 1:
            partial = any(g.base is not None and g.base.num_tokens < g.span.end - g.span.start
                          for g in gated)  # fmt: skip
            decisions["anchor_cover"] = "partial" if partial else "whole"
        if not notes.pooled:  # pooled anchors may sit in other placeholders' pools
            activated = tuple((g.placeholder_id, g.decision.activated_ids) for g in gated)
            notes = replace(notes, activated=activated)
        plan = self._reuse_call(exact, gated, prompt, ctx, notes.agent_id, bases)
        return PlannedCall(plan, records=tuple(bases), decisions=decisions, memo=notes)

    def _pooled_ids(
        self, prompt: SpannedPrompt, ctx: CallContext, decisions: dict[str, str]
    ) -> tuple[str, ...]:
        """PAL-KV's union: the pool ids of the prompt's answer placeholders, when the call is
        judge-like and pooling is on (else none; `decisions` says when it pools)."""
        if not self.config.pool_judges or not classify(prompt, ctx.decode_text).judge_like:
            return ()
        ids = tuple(dict.fromkeys(
            placeholder_id_of(s.name) for s in prompt.spans
            if s.kind == "placeholder" and is_agent_output(s.name)
        ))  # fmt: skip
        decisions["anchor_pool"] = f"pooled over {len(ids)} answer placeholders (judge)"
        return ids

    def after_call(
        self,
        prompt: SpannedPrompt,
        planned: PlannedCall[_Notes],
        state: ExecutionState,
        ctx: CallContext,
        response_ids: Sequence[int],
    ) -> None:
        if not isinstance(ctx, StoreContext):
            return
        records = call_records(prompt, planned, state, ctx, response_ids)  # bases first
        if response_ids and self.config.sender_bases:
            records.append(_sender_base_record(records[-1], ctx.fingerprint))
        put_records(ctx, records)
        notes = planned.memo
        if notes is None:
            return
        store = cast(AnchorStore, ctx.store)
        for placeholder_id, anchor_ids in notes.activated:
            store.touch_anchors(ctx.fingerprint, placeholder_id, anchor_ids)
        # After the first token: its costs are the call's store_s, not TTFT stages.
        after = replace(ctx, timings=CallTimings())
        bases: list[SpanRecord] = []
        for span in notes.to_anchor:
            self._add_anchor(span, prompt, state, after, notes, bases)
        put_records(after, bases)  # bases first computed for the anchors

    def _gate(
        self,
        span: PromptSpan,
        prompt: SpannedPrompt,
        ctx: StoreContext,
        notes: _Notes,
        bases: list[SpanRecord],
        *,
        plan_time: bool,
    ) -> _Gated | None:
        """The gate for one placeholder (None: no base — store unreachable, sender's K/V missing).

        At plan time a pool without two anchors long enough is dense without
        computing the base (the base is then paid after the first token).
        """
        store = cast(AnchorStore, ctx.store)
        agent_id = notes.agent_id
        tokens = prompt.token_ids[span.start : span.end]
        placeholder_id = placeholder_id_of(span.name)
        pooled = bool(notes.pooled)  # PAL-KV: any agent's anchors, answers' pools joined
        pool_ids = notes.pooled if pooled and is_agent_output(span.name) else (placeholder_id,)
        with timed(ctx.timings, "lookup_s"):
            listed = [
                (pid, entry)
                for pid in pool_ids
                for entry in store.get_anchors(ctx.fingerprint, pid, include_payloads=False)
            ]
        covered, usable = self._coverage(
            listed, len(tokens), agent_id, partial=plan_time, any_agent=pooled
        )
        if plan_time and len(usable) <= 1:
            return _Gated(span, placeholder_id, GateDecision(False, "too_few_eligible"))
        base = self._placeholder_base(span, tokens, ctx, bases)
        if base is None:
            return None
        if covered < base.num_tokens:  # causal: the first tokens' base is the base's start
            base = slice_segment(base, 0, covered)
        if pooled:
            pool = self._pooled_anchors(usable, agent_id, ctx)
        else:
            pool = self._pool(placeholder_id, [e for _, e in usable], agent_id, ctx)
        with timed(ctx.timings, "lookup_s"):
            decision = decide(base, pool, ctx.rope, self.config.gate, agent_id)
        return _Gated(span, placeholder_id, decision, base, pool)

    def _coverage(
        self,
        listed: Sequence[tuple[str, AnchorEntry]],
        num_tokens: int,
        agent_id: str,
        *,
        partial: bool,
        any_agent: bool = False,
    ) -> tuple[int, list[tuple[str, AnchorEntry]]]:
        """How many leading placeholder tokens to correct, and the anchors long enough.

        KVComm's length rule wants anchors as long as the placeholder. With
        `min_coverage` < 1 (and `partial`), the placeholder's first T_c tokens are
        corrected instead, T_c the second-longest anchor (two are needed to
        compare), when T_c ≥ min_coverage·T; the rest and the next text are
        computed. Token t's real K/V depend on tokens ≤ t only, so the first T_c
        tokens' offsets of a longer anchor are offsets of the same kind.
        listed: (pool id, entry); `any_agent` (PAL-KV) also takes other agents' anchors.
        """
        own = [(p, e) for p, e in listed if any_agent or agent_id in e.agent_ids]
        lengths = sorted((min(e.num_tokens, num_tokens) for _, e in own), reverse=True)
        least = math.ceil(self.config.min_coverage * num_tokens)
        covered = num_tokens
        if partial and len(lengths) >= 2 and least <= lengths[1] < num_tokens:
            covered = lengths[1]
        return covered, [(p, e) for p, e in own if e.num_tokens >= covered]

    def _pooled_anchors(
        self, listed: Sequence[tuple[str, AnchorEntry]], agent_id: str, ctx: StoreContext
    ) -> tuple[Anchor, ...]:
        """PAL-KV's pool: each listed anchor (once per id, its own pool first) with one
        agent's offsets — this agent's when it has them, else another's — filed under
        this agent, fetched and decoded per call (never cached: the filing is per call)."""
        store = cast(AnchorStore, ctx.store)
        fingerprint, dtype, device = ctx.fingerprint, ctx.decode_dtype, _device(ctx)
        pool: dict[str, Anchor] = {}
        for pid, listed_entry in listed:
            if listed_entry.anchor_id in pool or not listed_entry.agent_ids:
                continue
            ids = listed_entry.agent_ids
            sender = agent_id if agent_id in ids else sorted(ids)[0]
            with timed(ctx.timings, "fetch_s"):
                entries = self._fetch(store, fingerprint, pid, listed_entry.anchor_id, sender)
            with timed(ctx.timings, "decode_s"):
                for entry in entries:
                    anchor = decode_anchor(
                        entry, sender, fingerprint=fingerprint, dtype=dtype, device=device
                    )
                    offsets = None if anchor is None else anchor.offsets(sender)
                    if anchor is not None and offsets is not None:
                        pool[entry.anchor_id] = Anchor(
                            entry.anchor_id, anchor.base, {agent_id: offsets}
                        )
        return tuple(pool.values())

    def _pool(
        self, placeholder_id: str, listed: Sequence[AnchorEntry], agent_id: str, ctx: StoreContext
    ) -> tuple[Anchor, ...]:
        """The listed anchors this agent can use, decoded: from the worker's cache, or
        fetched one by one (an answer holds at most one anchor's worth of payloads)
        with only its own offsets."""
        store = cast(AnchorStore, ctx.store)
        fingerprint, dtype, device = ctx.fingerprint, ctx.decode_dtype, _device(ctx)
        keys = {
            e.anchor_id: AnchorKey(
                fingerprint, placeholder_id, e.anchor_id, e.created_seq, agent_id, dtype,
                str(device),
            )
            for e in listed
        }  # fmt: skip
        cached = {i: self._decoded.get(k) for i, k in keys.items()}
        with timed(ctx.timings, "fetch_s"):
            entries = [
                entry
                for anchor_id, anchor in cached.items()
                if anchor is None
                for entry in self._fetch(store, fingerprint, placeholder_id, anchor_id, agent_id)
                if agent_id in entry.agent_payloads
            ]
        with timed(ctx.timings, "decode_s"):
            for entry in entries:
                anchor = decode_anchor(
                    entry, agent_id, fingerprint=fingerprint, dtype=dtype, device=device
                )
                if anchor is not None:
                    cached[entry.anchor_id] = anchor
                    # the fetched incarnation may be newer than the listed one
                    key = replace(keys[entry.anchor_id], created_seq=entry.created_seq)
                    self._decoded.put(key, anchor)
        return tuple(a for a in cached.values() if a is not None)

    def _placeholder_base(
        self, span: PromptSpan, tokens: Sequence[int], ctx: StoreContext, bases: list[SpanRecord]
    ) -> SegmentKV | None:
        if self.config.sender_bases and is_agent_output(span.name):
            return _sender_base(tokens, ctx)
        return _base(tokens, ctx, self._lead(ctx), bases)

    def _lead(self, ctx: CallContext) -> tuple[int, ...]:
        if not self.config.base_lead:
            return ()
        return ctx.encode_text(self.config.base_lead)

    @staticmethod
    def _fetch(
        store: AnchorStore, fingerprint: str, placeholder_id: str, anchor_id: str, agent_id: str
    ) -> list[AnchorEntry]:
        return store.get_anchors(
            fingerprint, placeholder_id, anchor_ids=(anchor_id,), agent_id=agent_id
        )

    def _reuse_call(
        self,
        exact: CallPlan,
        gated: Sequence[_Gated],
        prompt: SpannedPrompt,
        ctx: CallContext,
        agent_id: str,
        bases: list[SpanRecord],
    ) -> CallPlan:
        """Exact prefix, corrected placeholders and next texts, the rest computed."""
        reused = [s for s in exact.spans if s.keys is not None]
        corrected: list[PlanSpan] = []
        for outcome in gated:
            corrected += self._corrected(outcome, prompt, ctx, agent_id, bases)
        if self.config.repair is not None:
            return self._repaired_call(prompt, reused, corrected)
        return CallPlan.tiled(prompt.token_ids, reused + corrected)

    def _repaired_call(
        self, prompt: SpannedPrompt, exact: Sequence[PlanSpan], corrected: Sequence[PlanSpan]
    ) -> CallPlan:
        """The corrected spans as CacheBlend chunks (see `AnchorConfig.repair`); the exact
        prefix is read at every layer."""
        assert self.config.repair is not None
        chunks = []
        for span in corrected:
            assert span.keys is not None and span.values is not None  # corrected K/V, every layer
            chunks.append(
                (span.start, SegmentKV(span.keys, span.values, start_position=span.start))
            )
        blended = blend_plan(prompt.token_ids, chunks, self.config.repair)
        by_start = {s.start: s for s in corrected}
        chunk_spans = [
            replace(s, name=by_start[s.start].name, source=by_start[s.start].source)
            for s in blended.spans
            if s.keys is not None
        ]
        return replace_spans(blended, tile_spans(len(prompt.token_ids), [*exact, *chunk_spans]))

    def _corrected(
        self,
        outcome: _Gated,
        prompt: SpannedPrompt,
        ctx: CallContext,
        agent_id: str,
        bases: list[SpanRecord],
    ) -> tuple[PlanSpan, ...]:
        """The placeholder's (and its next text's) corrected spans, each with its source."""
        assert outcome.base is not None
        span, base = outcome.span, outcome.base
        whole = base.num_tokens == span.end - span.start  # else the next text is computed
        next_span = _following_text(prompt, span) if whole else None
        next_base = None
        if next_span is not None and _all_have_prefix(outcome.pool, agent_id, next_span):
            next_base = _base(
                prompt.token_ids[next_span.start : next_span.end], ctx, self._lead(ctx), bases
            )
        query = AnchorQuery(agent_id, base, span.start, next_base)
        with timed(ctx.timings, "shift_s"):
            correction = correct(query, outcome.pool, ctx.rope, self.config.gate.weights)
        name = f"{MODE}@{span.start}"
        spans = anchor_spans(correction, name=name)
        placed = [(span.start, base)]
        if next_base is not None and next_span is not None:
            placed.append((next_span.start, next_base))
        return tuple(
            replace(s, source=Source(MODE, False, start, start - stored.start_position))
            for s, (start, stored) in zip(spans, placed, strict=False)
        )

    def _add_anchor(
        self,
        span: PromptSpan,
        prompt: SpannedPrompt,
        state: ExecutionState,
        ctx: StoreContext,
        notes: _Notes,
        bases: list[SpanRecord],
    ) -> None:
        """Gate again (now with the base) and, if still dense, store this agent's offsets
        (in the placeholder's own pool, pooled retrieval or not)."""
        agent_id = notes.agent_id
        outcome = self._gate(span, prompt, ctx, notes, bases, plan_time=False)
        if outcome is None or outcome.decision.reuse or outcome.base is None:
            return
        tokens = prompt.token_ids[span.start : span.end]
        # An existing anchor keeps its stored base (a sender base may have been
        # overwritten since by another sender of the same tokens): offsets must be
        # against the base they will be added to.
        base = self._stored_base(outcome.placeholder_id, tokens, agent_id, ctx) or outcome.base
        real = ctx.executor.read_kv(state, span.start, span.end)
        offsets = AgentOffsets(kv_offset(real, base, ctx.rope))
        next_span = _following_text(prompt, span)
        if next_span is not None:
            next_base = _base(
                prompt.token_ids[next_span.start : next_span.end], ctx, self._lead(ctx), bases
            )
            next_real = ctx.executor.read_kv(state, next_span.start, next_span.end)
            if next_base is not None:
                offsets = replace(offsets, prefix=kv_offset(next_real, next_base, ctx.rope))
        self._put_anchor(outcome.placeholder_id, tokens, base, offsets, agent_id, ctx)

    def _stored_base(
        self, placeholder_id: str, tokens: Sequence[int], agent_id: str, ctx: StoreContext
    ) -> SegmentKV | None:
        """The base of the pooled anchor of `tokens`, if there is one (fp32, model device)."""
        store = cast(AnchorStore, ctx.store)
        entries = self._fetch(
            store, ctx.fingerprint, placeholder_id, anchor_id_of(tokens), agent_id
        )
        for entry in entries:
            anchor = decode_anchor(
                entry, agent_id, fingerprint=ctx.fingerprint, dtype=torch.float32,
                device=_device(ctx),
            )  # fmt: skip
            if anchor is not None:
                return anchor.base
        return None

    def _put_anchor(
        self,
        placeholder_id: str,
        tokens: Sequence[int],
        base: SegmentKV,
        offsets: AgentOffsets,
        agent_id: str,
        ctx: StoreContext,
    ) -> None:
        """Put this agent's offsets for the anchor of `tokens` (the store keeps the other
        agents' offsets and, if the anchor is pooled already, its base)."""
        store, fingerprint, quant = cast(AnchorStore, ctx.store), ctx.fingerprint, self.config.quant
        anchor_id = anchor_id_of(tokens)
        self._decoded.discard(fingerprint, placeholder_id, anchor_id)  # offsets change below
        agent_payloads = {agent_id: encode_offsets(offsets, fingerprint=fingerprint, quant=quant)}
        base_payload = encode_base(base, fingerprint=fingerprint, quant=quant)
        nbytes = len(base_payload) + len(agent_payloads[agent_id])
        if nbytes > self.config.max_anchor_nbytes:
            logger.info(
                "anchor %s/%s needs %d bytes; not stored", placeholder_id, anchor_id, nbytes
            )
            return
        try:
            store.put_anchor(
                fingerprint, placeholder_id, anchor_id, base_payload, agent_payloads, len(tokens)
            )
        except ResourceExhausted as error:  # a full store costs later reuse, never this call
            logger.warning("store is full, anchor not stored: %s", error)


def _device(ctx: CallContext) -> torch.device:
    return ctx.executor.layerwise.adapter.device


def _base(
    tokens: Sequence[int], ctx: CallContext, lead: tuple[int, ...], bases: list[SpanRecord]
) -> SegmentKV | None:
    """The base K/V of `tokens` prefilled after `lead` (fetched, or computed and appended
    to `bases`, see `question_base`), fp32 on the model's device: where the call's real K/V
    are, so offsets and corrections mix them."""
    base = question_base(tuple(tokens), ctx, bases, lead)
    if base is None:
        return None
    return on_device(
        SegmentKV(base.keys.float(), base.values.float(), base.start_position), _device(ctx)
    )


def _sender_base(tokens: Sequence[int], ctx: StoreContext) -> SegmentKV | None:
    """The answer's K/V as its sender stored it (fp32, on the model's device); None if absent.

    Never computed here: a standalone prefill would be a base of another kind,
    and offsets against one kind do not correct the other.
    """
    ids = tuple(int(t) for t in tokens)
    key = context_key(sender_base_parent(ctx.fingerprint), ids)
    fetched = fetch_segment(
        ctx.store, key, fingerprint=ctx.fingerprint, dtype=ctx.decode_dtype, timings=ctx.timings
    )
    if fetched is None or fetched.meta.token_ids != ids:
        return None
    kv = fetched.kv
    return on_device(SegmentKV(kv.keys.float(), kv.values.float(), kv.start_position), _device(ctx))


def _sender_base_record(response: SpanRecord, fingerprint: str) -> SpanRecord:
    """The sender's answer K/V again, under `sender_base_parent` (see the module docstring)."""
    parent = sender_base_parent(fingerprint)
    return SpanRecord(response.kv, response.token_ids, parent, (), "", "sender-base")


def _following_text(prompt: SpannedPrompt, span: PromptSpan) -> PromptSpan | None:
    """The template text right after `span` (KVComm's "prefix" segment), if any."""
    return next((s for s in prompt.spans if s.start == span.end and s.kind == "text"), None)


def _all_have_prefix(pool: Sequence[Anchor], agent_id: str, next_span: PromptSpan) -> bool:
    """Whether every anchor recorded this agent's offset of a next text this long."""
    for anchor in pool:
        offsets = anchor.offsets(agent_id)
        if offsets is None or offsets.prefix is None:
            return False
        if offsets.prefix.num_tokens != next_span.end - next_span.start:
            return False
    return bool(pool)


@dataclass(frozen=True)
class Params:
    """anchor's parameters (`anchor:gamma=0.5+tau=0.1+metric=key+r=0.15+cover=0.5+pool=1`)."""

    gamma: float = knob(
        0.3, "gamma", "the gate's entropy threshold factor (H > γ·log2|A| → dense)",
        low=0, high=1, grid=(0.3, 0.5, 1.0), symbol="γ",
    )  # fmt: skip
    tau: float = knob(0.1, "tau", "the anchor weights' temperature", low=0, low_open=True)
    metric: str = knob("value", "metric", "the gate's distance", choices=("value", "key"))
    repair_ratio: float | None = knob(
        None, "r", "CacheBlend's ratio on the corrected K/V, or none (no repair)",
        low=0, high=1, grid=(0.15,), grid_with={"gamma": 1.0},
    )  # fmt: skip
    min_coverage: float = knob(
        1.0, "cover", "the share of a placeholder its anchors must cover (1: KVComm's length rule)",
        low=0, low_open=True, high=1,
    )  # fmt: skip
    pool_judges: int = knob(
        0, "pool", "PAL-KV: 1 pools a judge-like call's answer anchors across placeholders "
        "and agents; 0: KVComm's per-placeholder, per-agent pools", low=0, high=1,
    )  # fmt: skip

    def __post_init__(self) -> None:
        check_ranges(self)

    def config(self) -> AnchorConfig:
        weights = WeightConfig(tau=self.tau)
        gate = GateConfig(gamma=self.gamma, metric=cast(Metric, self.metric), weights=weights)
        ratio = self.repair_ratio
        repair = None if ratio is None else BlendConfig(ratio=ratio)
        return AnchorConfig(
            gate=gate, repair=repair, min_coverage=self.min_coverage,
            pool_judges=bool(self.pool_judges),
        )  # fmt: skip


SPEC = ModeSpec(MODE, Params, lambda p: AnchorPolicy(p.config()))
