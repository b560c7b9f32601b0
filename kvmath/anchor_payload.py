"""KVComm anchors ⇄ store payloads: one `kvmath.payload` per tensor group, engine-neutral.

The base payload: the span's base K/V [L, H_kv, T_a, D]. One agent's payload: its
placeholder offset and, when recorded, the next text's offset right after it,
concatenated along tokens into one segment (consecutive positions); the anchor's
`num_tokens` T_a splits them. Deciding when to add or use an anchor is the engine's.
"""

from __future__ import annotations

import logging

import torch

from kvsplice.common.errors import CorruptPayload
from kvsplice.kvmath.anchors import AgentOffsets, Anchor
from kvsplice.kvmath.payload import decode_payload, encode_payload
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)


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


def decode_anchor_payloads(
    anchor_id: str,
    num_tokens: int,
    base_payload: bytes,
    agent_payload: bytes | None,
    agent_id: str,
    *,
    fingerprint: str,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> Anchor | None:
    """An anchor's payloads as an `Anchor` holding only `agent_id`'s offsets (`agent_payload`,
    None: no offsets); None if a payload is corrupt or disagrees with `num_tokens`.

    Tensors land on `device` (the correction runs where the query's base is).
    """
    try:
        base = decode_payload(base_payload, expect_fingerprint=fingerprint, dtype=dtype)
        joined = None
        if agent_payload is not None:
            joined = decode_payload(agent_payload, expect_fingerprint=fingerprint, dtype=dtype)
    except CorruptPayload as error:  # a corrupt anchor is a miss, never a correction
        logger.warning("anchor %s failed verification (%s); skipped", anchor_id, error)
        return None
    if base.num_tokens != num_tokens or (joined and joined.num_tokens < num_tokens):
        logger.warning("anchor %s payloads disagree with its length; skipped", anchor_id)
        return None
    base = on_device(base, device)
    offsets = {}
    if joined is not None:
        offsets[agent_id] = split_offsets(on_device(joined, device), num_tokens)
    return Anchor(anchor_id, base, offsets)


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
