"""The sidecar speaks vLLM's KV event wire format: vLLM's own classes and decoder (the oracle)
read what `server.kv_event_publisher` sends, live and replayed, as they read vLLM's publisher.
A schema that strays (the batch's array order, a tag) fails that oracle."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from vllm.distributed import kv_events as vllm_events

from kvsplice.common.segment import SegmentMeta
from kvsplice.server import kv_event_wire as ours
from kvsplice.server.kv_event_publisher import KvEventPublisher, KvEventsConfig

VLLM_DECODER = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
HASHES = tuple(bytes([i]) * 32 for i in range(1, 5))


def stored_meta(namespace: str = "ns") -> SegmentMeta:
    from kvsplice.common.keys import root_key
    from kvsplice.common.segment import chained_meta

    fingerprint = "kvfp1-" + "0" * 32
    return chained_meta(
        namespace, fingerprint, root_key(fingerprint), range(16), 0, 2,
        engine_block_hashes=HASHES[:2], engine_parent_block_hash=HASHES[3],
    )  # fmt: skip


def test_our_bytes_equal_vllms_for_the_same_events() -> None:
    stored = ours.block_stored(HASHES[:2], HASHES[3], list(range(16)), "int")
    removed = ours.block_removed(HASHES[:1], "bytes")
    theirs = vllm_events.KVEventBatch(
        ts=1.5,
        events=[
            vllm_events.BlockStored(
                block_hashes=stored.block_hashes, parent_block_hash=stored.parent_block_hash,
                token_ids=list(range(16)), block_size=8, lora_id=None, medium="kvsplice",
                lora_name=None, group_idx=0,
            ),
            vllm_events.BlockRemoved(block_hashes=[HASHES[0]], medium="kvsplice", group_idx=0),
            vllm_events.AllBlocksCleared(),
        ],
    )  # fmt: skip
    payload = ours.encode_batch(1.5, [stored, removed, ours.AllBlocksCleared()])
    assert payload == msgspec.msgpack.Encoder().encode(theirs)
    assert VLLM_DECODER.decode(payload) == theirs


class _WrongOrder(msgspec.Struct, array_like=True):
    events: list[ours.KvEvent]
    ts: float


class _WrongTag(msgspec.Struct, tag="BlockSaved", omit_defaults=True):
    block_hashes: list[int]
    medium: str | None


@pytest.mark.parametrize(
    "payload",
    [
        msgspec.msgpack.encode(_WrongOrder([ours.AllBlocksCleared()], 1.0)),
        msgspec.msgpack.encode((1.0, [_WrongTag([1], "kvsplice")])),
        msgspec.msgpack.encode((1.0, [{"type": "BlockStored", "block_hashes": [1]}])),
    ],
    ids=["batch-fields-swapped", "unknown-tag", "required-fields-missing"],
)
def test_the_oracle_refuses_a_schema_that_strays(payload: bytes) -> None:
    with pytest.raises(msgspec.ValidationError):
        VLLM_DECODER.decode(payload)


@pytest.fixture
def publisher() -> Iterator[KvEventPublisher]:
    config = KvEventsConfig(
        endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="kv-events"
    )
    publisher = KvEventPublisher(config)
    yield publisher
    publisher.close()


def test_vllms_subscriber_reads_the_sidecars_stream_and_replay(
    publisher: KvEventPublisher,
) -> None:
    """As vLLM's example subscriber (SUB on the topic) and its tests' replay (a DEALER)."""
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    sub.connect(publisher.endpoint)
    time.sleep(0.2)
    meta = stored_meta()
    publisher.indexed(meta)
    publisher.unindexed(meta.namespace, meta.context_key)
    live: list[tuple[int, vllm_events.KVEventBatch]] = []
    while not any(isinstance(e, vllm_events.BlockRemoved) for _, b in live for e in b.events):
        assert sub.poll(2000)
        _, seq_bytes, payload = sub.recv_multipart()
        live.append((int.from_bytes(seq_bytes, "big"), VLLM_DECODER.decode(payload)))
    live = [(seq, b) for seq, b in live if seq > 0]  # the start's AllBlocksCleared, if seen
    stored, removed = [event for _, batch in live for event in batch.events]
    assert isinstance(stored, vllm_events.BlockStored)
    assert isinstance(removed, vllm_events.BlockRemoved)
    # vLLM's default int form of its hash bytes (maybe_convert_block_hash)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    assert stored.block_hashes == [maybe_convert_block_hash(h) for h in HASHES[:2]]
    assert stored.parent_block_hash == maybe_convert_block_hash(HASHES[3])
    assert stored.block_size == 8 and stored.medium == "kvsplice"
    assert sorted(removed.block_hashes) == sorted(stored.block_hashes)

    dealer = context.socket(zmq.DEALER)
    assert publisher.replay_endpoint is not None
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed = []
    while dealer.poll(2000):
        _, topic, seq, body = dealer.recv_multipart()
        if not body:
            assert seq == vllm_events.ZmqEventPublisher.END_SEQ
            break
        assert topic == b"kv-events"
        replayed.append((int.from_bytes(seq, "big"), VLLM_DECODER.decode(body)))
    assert replayed[0][0] == 0  # the start: AllBlocksCleared
    assert replayed[0][1].events == [vllm_events.AllBlocksCleared()]
    assert replayed[1:] == live
    sub.close(linger=0)
    dealer.close(linger=0)
