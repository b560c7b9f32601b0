"""An anchor pool as one call reads it (covering anchors, decoded, and bases), and its byte form.

Owns `coverage` (KVComm's length rule, or partial coverage), reading a pool (`own_pool`:
this agent's offsets, kept decoded between calls in `DecodedAnchors`; `pooled_anchors`:
PAL-KV's union, per call), the bases offsets are taken against (`lead_base`,
`sender_base`, `stored_base`) and the sender-base record. When to gate, correct or add
an anchor is the policy's. Also owns the ids pools and anchors are keyed by.

`DecodedAnchors`: the anchor gate needs a placeholder's whole pool on
every call; fetching and dequantizing each anchor again (a base plus one
agent's offsets: megabytes per anchor) is most of the gate's cost. An entry
is keyed by the anchor's `created_seq` as the store lists it, so an anchor
evicted and created again (a new base, new offsets) is a different entry
and the listing itself tells a stale entry apart; only the listing is asked
for on every call.

NOTE: offsets an agent re-puts for an anchor already pooled (the same agent
template seen again in another context) are seen here only once the entry
leaves the cache, or at once when this worker puts them (`discard`). Both are
offsets of that agent against the same stored base, so either corrects.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvsplice.client.execute.execution import timed
from kvsplice.client.modes.base import CallContext, StoreContext
from kvsplice.client.modes.shared import question_base
from kvsplice.client.tiers.segment_io import SpanRecord, fetch_segment
from kvsplice.common.keys import content_key, context_key, sender_base_root
from kvsplice.kvmath.anchor_payload import decode_anchor_payloads, on_device
from kvsplice.kvmath.anchors import Anchor
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.results import AnchorEntry

logger = logging.getLogger(__name__)

Listed = Sequence[tuple[str, AnchorEntry]]  # (pool id, entry) as the store lists them


@dataclass(frozen=True)
class AnchorKey:
    """What makes a decoded anchor reusable: whose offsets, which anchor incarnation, what form."""

    fingerprint: str
    placeholder_id: str
    anchor_id: str
    created_seq: int
    agent_id: str
    dtype: torch.dtype
    device: str


def anchor_nbytes(anchor: Anchor) -> int:
    """Bytes held by an anchor's tensors (base and every agent's offsets)."""
    segments = [anchor.base]
    for offsets in anchor.offsets_by_agent.values():
        segments.append(offsets.placeholder)
        if offsets.prefix is not None:
            segments.append(offsets.prefix)
    return sum(s.keys.nbytes + s.values.nbytes for s in segments)


class DecodedAnchors:
    """Least-recently-used decoded anchors up to `max_bytes` (0 keeps nothing). Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes {max_bytes} must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[AnchorKey, tuple[Anchor, int]] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: AnchorKey) -> Anchor | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found[0]

    def put(self, key: AnchorKey, anchor: Anchor) -> None:
        """Keep `anchor` (an anchor larger than the whole budget is not kept)."""
        size = anchor_nbytes(anchor)
        if size > self.max_bytes:
            return
        with self._lock:
            self._pop(key)
            self._entries[key] = (anchor, size)
            self._nbytes += size
            while self._nbytes > self.max_bytes:
                self._pop(next(iter(self._entries)))

    def discard(self, fingerprint: str, placeholder_id: str, anchor_id: str) -> int:
        """Drop every entry of one anchor (any incarnation, agent or form); how many."""
        with self._lock:
            stale = [
                k
                for k in self._entries
                if (k.fingerprint, k.placeholder_id, k.anchor_id)
                == (fingerprint, placeholder_id, anchor_id)
            ]
            for key in stale:
                self._pop(key)
            return len(stale)

    def _pop(self, key: AnchorKey) -> None:
        found = self._entries.pop(key, None)
        if found is not None:
            self._nbytes -= found[1]


def coverage(
    listed: Listed,
    num_tokens: int,
    agent_id: str,
    min_coverage: float,
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
    `any_agent` (PAL-KV) also takes other agents' anchors.
    """
    own = [(p, e) for p, e in listed if any_agent or agent_id in e.agent_ids]
    lengths = sorted((min(e.num_tokens, num_tokens) for _, e in own), reverse=True)
    least = math.ceil(min_coverage * num_tokens)
    covered = num_tokens
    if partial and len(lengths) >= 2 and least <= lengths[1] < num_tokens:
        covered = lengths[1]
    return covered, [(p, e) for p, e in own if e.num_tokens >= covered]


def pooled_anchors(listed: Listed, agent_id: str, ctx: StoreContext) -> tuple[Anchor, ...]:
    """PAL-KV's pool: each listed anchor (once per id, its own pool first) with one
    agent's offsets — this agent's when it has them, else another's — filed under
    this agent, fetched and decoded per call (never cached: the filing is per call)."""
    fingerprint, dtype, device = ctx.fingerprint, ctx.decode_dtype, model_device(ctx)
    pool: dict[str, Anchor] = {}
    for pid, listed_entry in listed:
        if listed_entry.anchor_id in pool or not listed_entry.agent_ids:
            continue
        ids = listed_entry.agent_ids
        sender = agent_id if agent_id in ids else sorted(ids)[0]
        with timed(ctx.timings, "fetch_s"):
            entries = fetch_anchor(ctx.store, fingerprint, pid, listed_entry.anchor_id, sender)
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


def own_pool(
    placeholder_id: str,
    listed: Sequence[AnchorEntry],
    agent_id: str,
    ctx: StoreContext,
    decoded: DecodedAnchors,
) -> tuple[Anchor, ...]:
    """The listed anchors this agent can use, decoded: from `decoded`, or fetched one by
    one (an answer holds at most one anchor's worth of payloads) with only its own
    offsets, and kept there."""
    fingerprint, dtype, device = ctx.fingerprint, ctx.decode_dtype, model_device(ctx)
    keys = {
        e.anchor_id: AnchorKey(
            fingerprint, placeholder_id, e.anchor_id, e.created_seq, agent_id, dtype,
            str(device),
        )
        for e in listed
    }  # fmt: skip
    cached = {i: decoded.get(k) for i, k in keys.items()}
    with timed(ctx.timings, "fetch_s"):
        entries = [
            entry
            for anchor_id, anchor in cached.items()
            if anchor is None
            for entry in fetch_anchor(ctx.store, fingerprint, placeholder_id, anchor_id, agent_id)
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
                decoded.put(key, anchor)
    return tuple(a for a in cached.values() if a is not None)


def fetch_anchor(
    store: StoreClient, fingerprint: str, placeholder_id: str, anchor_id: str, agent_id: str
) -> list[AnchorEntry]:
    """One anchor's entries with `agent_id`'s payloads (none: the store has no such anchor)."""
    return store.get_anchors(
        fingerprint, placeholder_id, anchor_ids=(anchor_id,), agent_id=agent_id
    )


def stored_base(
    placeholder_id: str, tokens: Sequence[int], agent_id: str, ctx: StoreContext
) -> SegmentKV | None:
    """The base of the pooled anchor of `tokens`, if there is one (fp32, model device)."""
    entries = fetch_anchor(
        ctx.store, ctx.fingerprint, placeholder_id, anchor_id_of(tokens), agent_id
    )
    for entry in entries:
        anchor = decode_anchor(
            entry, agent_id, fingerprint=ctx.fingerprint, dtype=torch.float32,
            device=model_device(ctx),
        )  # fmt: skip
        if anchor is not None:
            return anchor.base
    return None


def model_device(ctx: CallContext) -> torch.device:
    """Where the call's real K/V are, so offsets and corrections mix with them."""
    return ctx.executor.device


def lead_base(
    tokens: Sequence[int], ctx: CallContext, lead: tuple[int, ...], bases: list[SpanRecord]
) -> SegmentKV | None:
    """The base K/V of `tokens` prefilled after `lead` (fetched, or computed and appended
    to `bases`, see `question_base`), fp32 on the model's device."""
    base = question_base(tuple(tokens), ctx, bases, lead)
    if base is None:
        return None
    with timed(ctx.timings, "decode_s"):
        kv = base.decode(torch.float32)
    return on_device(SegmentKV(kv.keys, kv.values, kv.start_position), model_device(ctx))


def sender_base(tokens: Sequence[int], ctx: StoreContext) -> SegmentKV | None:
    """The answer's K/V as its sender stored it (fp32, on the model's device); None if absent.

    Never computed here: a standalone prefill would be a base of another kind,
    and offsets against one kind do not correct the other.
    """
    ids = tuple(int(t) for t in tokens)
    key = context_key(sender_base_parent(ctx.fingerprint), ids)
    fetched = fetch_segment(ctx.store, key, fingerprint=ctx.fingerprint, timings=ctx.timings)
    if fetched is None or fetched.meta.token_ids != ids:
        return None
    with timed(ctx.timings, "decode_s"):
        kv = fetched.kv.decode(torch.float32)
    return on_device(SegmentKV(kv.keys, kv.values, kv.start_position), model_device(ctx))


def sender_base_record(response: SpanRecord, fingerprint: str) -> SpanRecord:
    """The sender's answer K/V again, under `sender_base_parent` (an answer's base, as the
    policy's module docstring says)."""
    parent = sender_base_parent(fingerprint)
    return SpanRecord(response.kv, response.token_ids, parent, (), "", "sender-base")


# The ids the store keys pools and anchors by (the byte form is `kvmath.anchor_payload`'s).


def placeholder_id_of(name: str) -> str:
    """The pool id of a template placeholder: its name, stable across samples and agents.

    Store ids allow no "_" (they are blob path parts), so "user_question" -> "user.question".
    """
    return name.replace("_", ".")


# KVComm's grammar: `agent_<id>_current` / `agent_<id>_history_<turn>` hold another
# agent's answer (agents.template.Placeholder.is_agent_output; client cannot import it).
AGENT_OUTPUT_PREFIX = "agent_"


def is_agent_output(placeholder_name: str) -> bool:
    """Whether a placeholder holds another agent's answer (its base is the sender's K/V)."""
    return placeholder_name.startswith(AGENT_OUTPUT_PREFIX)


def sender_base_parent(fingerprint: str) -> bytes:
    """The parent key under which senders store their answers' K/V for anchor bases: an
    answer sits at context_key(sender_base_parent(fp), answer ids), found by content."""
    return sender_base_root(fingerprint)


def anchor_id_of(token_ids: Sequence[int]) -> str:
    """An anchor's id: the hex content key of its placeholder tokens.

    Every agent that meets the same sample names the same anchor, so their
    offsets join one entry (KVComm keys anchors by the sample's text).
    """
    return content_key(tuple(int(t) for t in token_ids)).hex()


def decode_anchor(
    entry: AnchorEntry,
    agent_id: str,
    *,
    fingerprint: str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> Anchor | None:
    """`entry` as an `Anchor` holding only `agent_id`'s offsets (`kvmath.anchor_payload`)."""
    return decode_anchor_payloads(
        entry.anchor_id, entry.num_tokens, entry.base_payload,
        entry.agent_payloads.get(agent_id), agent_id,
        fingerprint=fingerprint, dtype=dtype, device=device,
    )  # fmt: skip
