"""vLLM's KV event wire format, spoken without vLLM: the msgspec structs of its `KVEventBatch`
and the ZMQ frames its `ZmqEventPublisher` sends, so vLLM's own subscriber decodes ours.

Owns the schema (vLLM 0.32 `vllm.distributed.kv_events`: field names, the class-name tags,
the batch's array layout) and the frames; not which events are due (`kv_event_log`).
`tests/integrations/vllm/test_kv_event_wire.py` decodes these bytes with vLLM's classes.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvsplice.common.engine_blocks import KV_EVENTS_MEDIUM

ExternalBlockHash = bytes | int  # vLLM's: its hash bytes, or their low 64 bits (the default)
HASH_FORMATS = ("int", "bytes")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame


class KvCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Tagged by class name in field "type", as vLLM's `KVCacheEvent`."""


class BlockStored(KvCacheEvent, tag="BlockStored"):
    # NOTE: the fields without defaults are the ones vLLM requires; always encoded.
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(KvCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KvCacheEvent, tag="AllBlocksCleared"):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's `KVEventBatch`: an array [ts, events(, data_parallel_rank)]."""

    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes, hash_format: str) -> ExternalBlockHash:
    """`block_hash` as vLLM publishes it: its bytes, or (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES,
    on by default) the integer of its last 8 bytes, big-endian."""
    if hash_format == "bytes":
        return block_hash
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def block_stored(
    hashes: Sequence[bytes], parent: bytes, token_ids: Sequence[int], hash_format: str
) -> BlockStored:
    """The event of blocks `hashes` holding `token_ids` (whole blocks), after `parent`."""
    return BlockStored(
        block_hashes=[external_hash(h, hash_format) for h in hashes],
        parent_block_hash=external_hash(parent, hash_format) if parent else None,
        token_ids=list(token_ids),
        block_size=len(token_ids) // len(hashes),
        lora_id=None,
        medium=KV_EVENTS_MEDIUM,
        lora_name=None,
        group_idx=0,
    )


def block_removed(hashes: Sequence[bytes], hash_format: str) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=[external_hash(h, hash_format) for h in hashes],
        medium=KV_EVENTS_MEDIUM,
        group_idx=0,
    )


_ENCODER = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[KvEvent]) -> bytes:
    return _ENCODER.encode(KvEventBatch(ts=ts, events=events))


def frames(topic: bytes, seq: int, payload: bytes) -> tuple[bytes, bytes, bytes]:
    """One published batch: (topic, sequence number as 8 bytes big-endian, payload)."""
    return topic, seq.to_bytes(8, "big"), payload
