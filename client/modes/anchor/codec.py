"""KVComm anchors ⇄ store payloads: ids, the base payload and one payload per agent.

Owns the byte form of an `Anchor` (one `kvmath.payload` per tensor group) and the
ids the store keys pools and anchors by. Deciding when to add or use an anchor
is the anchor policy's; pool bookkeeping is the store's.

Agent payload: the placeholder offset [L, H_kv, T_a, D] and, when recorded, the
next text's offset right after it, concatenated along tokens into one segment
(they sit at consecutive positions); the anchor's `num_tokens` T_a splits them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvsplice.client.modes.anchor.anchors import AgentOffsets, Anchor
from kvsplice.client.store.store_types import AnchorEntry
from kvsplice.common.errors import CorruptPayload
from kvsplice.common.keys import content_key, sender_base_root
from kvsplice.kvmath.payload import decode_payload, encode_payload
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)


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


def encode_base(base: SegmentKV, *, fingerprint: str, quant: str) -> bytes:
    """The base payload: the placeholder's standalone K/V (boundary states dropped)."""
    plain = SegmentKV(base.keys, base.values, base.start_position, base.layer_start)
    return encode_payload(plain, model_fingerprint=fingerprint, quant=quant)


def encode_offsets(offsets: AgentOffsets, *, fingerprint: str, quant: str) -> bytes:
    """One agent's payload: placeholder offset, then the next text's offset when present."""
    placeholder = offsets.placeholder.keys.float(), offsets.placeholder.values.float()
    keys, values = [placeholder[0]], [placeholder[1]]
    if offsets.prefix is not None:
        if offsets.prefix.start_position != offsets.placeholder.start_position + _tokens(offsets):
            raise ValueError("the next text's offset must start right after the placeholder's")
        keys.append(offsets.prefix.keys.float())
        values.append(offsets.prefix.values.float())
    joined = SegmentKV(
        torch.cat(keys, dim=2), torch.cat(values, dim=2),
        offsets.placeholder.start_position, offsets.placeholder.layer_start,
    )  # fmt: skip
    return encode_payload(joined, model_fingerprint=fingerprint, quant=quant)


def decode_anchor(
    entry: AnchorEntry,
    agent_id: str,
    *,
    fingerprint: str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> Anchor | None:
    """`entry` as an `Anchor` holding only `agent_id`'s offsets; None if a payload is corrupt.

    Other agents' payloads are left undecoded: they could not serve this agent.
    Tensors land on `device` (the correction runs where the query's base is).
    """
    try:
        base = decode_payload(entry.base_payload, expect_fingerprint=fingerprint, dtype=dtype)
        payload = entry.agent_payloads.get(agent_id)
        joined = None
        if payload is not None:
            joined = decode_payload(payload, expect_fingerprint=fingerprint, dtype=dtype)
    except CorruptPayload as error:  # a corrupt anchor is a miss, never a correction
        logger.warning("anchor %s failed verification (%s); skipped", entry.anchor_id, error)
        return None
    if base.num_tokens != entry.num_tokens or (joined and joined.num_tokens < entry.num_tokens):
        logger.warning("anchor %s payloads disagree with its length; skipped", entry.anchor_id)
        return None
    base = on_device(base, device)
    offsets = {}
    if joined is not None:
        offsets[agent_id] = split_offsets(on_device(joined, device), entry.num_tokens)
    return Anchor(entry.anchor_id, base, offsets)


def on_device(segment: SegmentKV, device: torch.device | str) -> SegmentKV:
    """`segment`'s K/V on `device` (no copy when already there; boundary states dropped)."""
    keys, values = segment.keys.to(device), segment.values.to(device)
    return SegmentKV(keys, values, segment.start_position, segment.layer_start)


def split_offsets(joined: SegmentKV, num_placeholder_tokens: int) -> AgentOffsets:
    """The inverse of the concatenation in `encode_offsets`."""
    placeholder = joined.tokens(0, num_placeholder_tokens)
    if joined.num_tokens == num_placeholder_tokens:
        return AgentOffsets(placeholder)
    prefix = joined.tokens(num_placeholder_tokens, joined.num_tokens)
    return AgentOffsets(placeholder, prefix)


def _tokens(offsets: AgentOffsets) -> int:
    return offsets.placeholder.num_tokens
