"""Mode `anchor` (KVComm): placeholders corrected from an anchor pool, or dense plus a new anchor.

Per placeholder after the exact prefix: its base K/V, the placeholder's pool decoded
with this agent's offsets, and the gate. All confident → one call
reusing each placeholder and the text after it as corrected K/V. Otherwise the
call is dense (KVComm: an agent relying on an unshareable placeholder prefills)
and, after its first token, each such placeholder joins (or becomes) an anchor
with this agent's real − base offsets. Reading pools and bases is `pools`'s;
the parameters are `params`'s.

Bases, as KVComm builds them: another agent's answer (`agent_*` placeholders)
has the K/V its sender computed (the sender stores it after its call under
`sender_base_parent`), so an offset is only the change of context from sender
to receiver; a question (or tool output) is prefilled after a neutral lead
(`shared.question_base`, paid in the TTFT of the call that computes it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import xxhash

from kvsplice.client.execute.execution import CallTimings, ExecutionState, timed
from kvsplice.client.execute.plan import CallPlan, PlanSpan, Source, tile_spans
from kvsplice.client.modes.anchor.params import Params
from kvsplice.client.modes.anchor.pools import (
    DecodedAnchors,
    anchor_id_of,
    coverage,
    is_agent_output,
    lead_base,
    own_pool,
    placeholder_id_of,
    pooled_anchors,
    sender_base,
    sender_base_record,
    stored_base,
)
from kvsplice.client.modes.anchor.spans import anchor_spans
from kvsplice.client.modes.base import (
    CallContext,
    ModeSpec,
    PlanBuilder,
    PlannedCall,
    PromptSpan,
    SpannedPrompt,
    StoreContext,
)
from kvsplice.client.modes.recorder import RecordingPolicy, call_records, put_records
from kvsplice.client.modes.risk_gate import classify
from kvsplice.client.modes.shared import blend_plan, blend_rule, plan_exact_prefix, replace_spans
from kvsplice.client.tiers.segment_io import SpanRecord
from kvsplice.common.errors import ResourceExhausted
from kvsplice.common.reuse_modes import ANCHOR
from kvsplice.kvmath.anchor_correction import AnchorQuery, correct
from kvsplice.kvmath.anchor_gate import GateDecision, decide
from kvsplice.kvmath.anchor_payload import encode_base, encode_offsets
from kvsplice.kvmath.anchors import AgentOffsets, Anchor, kv_offset
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

MODE = ANCHOR
# The repair's check layer: every corrected token is computed through it (CacheBlend).
REPAIR_CHECK_LAYER = 1


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

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or Params()
        self._decoded = DecodedAnchors(self.params.decoded_cache_bytes)

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
        if self.params.min_coverage < 1:
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
        if not self.params.pool_judges or not classify(prompt, ctx.decode_text).judge_like:
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
        if response_ids and self.params.sender_bases:
            records.append(sender_base_record(records[-1], ctx.fingerprint))
        put_records(ctx, records)
        notes = planned.memo
        if notes is None:
            return
        for placeholder_id, anchor_ids in notes.activated:
            ctx.store.touch_anchors(ctx.fingerprint, placeholder_id, anchor_ids)
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
        agent_id = notes.agent_id
        tokens = prompt.token_ids[span.start : span.end]
        placeholder_id = placeholder_id_of(span.name)
        pooled = bool(notes.pooled)  # PAL-KV: any agent's anchors, answers' pools joined
        pool_ids = notes.pooled if pooled and is_agent_output(span.name) else (placeholder_id,)
        with timed(ctx.timings, "lookup_s"):
            listed = [
                (pid, entry)
                for pid in pool_ids
                for entry in ctx.store.get_anchors(ctx.fingerprint, pid, include_payloads=False)
            ]
        covered, usable = coverage(
            listed, len(tokens), agent_id, self.params.min_coverage,
            partial=plan_time, any_agent=pooled,
        )  # fmt: skip
        if plan_time and len(usable) <= 1:
            return _Gated(span, placeholder_id, GateDecision(False, "too_few_eligible"))
        base = self._placeholder_base(span, tokens, ctx, bases)
        if base is None:
            return None
        if covered < base.num_tokens:  # causal: the first tokens' base is the base's start
            base = base.tokens(0, covered)
        if pooled:
            pool = pooled_anchors(usable, agent_id, ctx)
        else:
            listed_own = [e for _, e in usable]
            pool = own_pool(placeholder_id, listed_own, agent_id, ctx, self._decoded)
        params = self.params
        with timed(ctx.timings, "lookup_s"):
            decision = decide(
                base, pool, ctx.rope, agent_id,
                gamma=params.gamma, metric=params.metric, tau=params.tau,
            )  # fmt: skip
        return _Gated(span, placeholder_id, decision, base, pool)

    def _placeholder_base(
        self, span: PromptSpan, tokens: Sequence[int], ctx: StoreContext, bases: list[SpanRecord]
    ) -> SegmentKV | None:
        if self.params.sender_bases and is_agent_output(span.name):
            return sender_base(tokens, ctx)
        return lead_base(tokens, ctx, self._lead(ctx), bases)

    def _lead(self, ctx: CallContext) -> tuple[int, ...]:
        if not self.params.base_lead:
            return ()
        return ctx.encode_text(self.params.base_lead)

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
        reused = [s for s in exact.spans if s.kv is not None]
        corrected: list[PlanSpan] = []
        for outcome in gated:
            corrected += self._corrected(outcome, prompt, ctx, agent_id, bases)
        if self.params.repair_ratio is not None:
            return self._repaired_call(prompt, reused, corrected, self.params.repair_ratio)
        return CallPlan.tiled(prompt.token_ids, reused + corrected)

    def _repaired_call(
        self,
        prompt: SpannedPrompt,
        exact: Sequence[PlanSpan],
        corrected: Sequence[PlanSpan],
        ratio: float,
    ) -> CallPlan:
        """The corrected spans as CacheBlend chunks (see `Params.repair_ratio`); the exact
        prefix is read at every layer."""
        chunks = []
        for span in corrected:
            assert isinstance(span.kv, SegmentKV)  # corrected K/V, every layer, in place
            chunks.append((span.start, span.kv))
        blended = blend_plan(prompt.token_ids, chunks, blend_rule(REPAIR_CHECK_LAYER, ratio))
        by_start = {s.start: s for s in corrected}
        chunk_spans = [
            replace(s, name=by_start[s.start].name, source=by_start[s.start].source)
            for s in blended.spans
            if s.kv is not None
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
            next_base = lead_base(
                prompt.token_ids[next_span.start : next_span.end], ctx, self._lead(ctx), bases
            )
        query = AnchorQuery(agent_id, base, span.start, next_base)
        with timed(ctx.timings, "shift_s"):
            correction = correct(query, outcome.pool, ctx.rope, self.params.tau)
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
        base = stored_base(outcome.placeholder_id, tokens, agent_id, ctx) or outcome.base
        real = ctx.executor.read_kv(state, span.start, span.end)
        offsets = AgentOffsets(kv_offset(real, base, ctx.rope))
        next_span = _following_text(prompt, span)
        if next_span is not None:
            next_base = lead_base(
                prompt.token_ids[next_span.start : next_span.end], ctx, self._lead(ctx), bases
            )
            next_real = ctx.executor.read_kv(state, next_span.start, next_span.end)
            if next_base is not None:
                offsets = replace(offsets, prefix=kv_offset(next_real, next_base, ctx.rope))
        self._put_anchor(outcome.placeholder_id, tokens, base, offsets, agent_id, ctx)

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
        store, fingerprint, quant = ctx.store, ctx.fingerprint, self.params.quant
        anchor_id = anchor_id_of(tokens)
        self._decoded.discard(fingerprint, placeholder_id, anchor_id)  # offsets change below
        agent_payloads = {agent_id: encode_offsets(offsets, fingerprint=fingerprint, quant=quant)}
        base_payload = encode_base(base, fingerprint=fingerprint, quant=quant)
        nbytes = len(base_payload) + len(agent_payloads[agent_id])
        if nbytes > self.params.max_anchor_nbytes:
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


SPEC = ModeSpec(MODE, Params, AnchorPolicy)
