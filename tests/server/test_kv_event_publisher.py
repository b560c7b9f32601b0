"""The sidecar's KV event stream: which events the index's changes make due, the ZMQ frames
and replays of vLLM's publisher, removals within a second. Decoded here with our own schema;
`tests/integrations/vllm/test_kv_event_wire.py` decodes the same bytes with vLLM's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
import zmq
from helpers.kv_event_state import held_after
from helpers.store import NAMESPACE, make_chain, make_meta, make_payload, make_service

from kvsplice.common.segment import SegmentMeta
from kvsplice.proto.segment_stream import header_to_meta, meta_to_header
from kvsplice.server.kv_event_log import Cleared, KvEventLog
from kvsplice.server.kv_event_publisher import KvEventPublisher, KvEventsConfig
from kvsplice.server.kv_event_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    external_hash,
)
from kvsplice.storage.segment_codec import decode_meta, encode_meta

DECODER = msgspec.msgpack.Decoder(KvEventBatch)
BLOCK = 4


def hashes(seed: int, n: int) -> tuple[bytes, ...]:
    return tuple(bytes([seed, i]) * 16 for i in range(n))


def engine_chain(num_chunks: int, seed: int = 1) -> list[tuple[SegmentMeta, bytes]]:
    """Chunks of 8 tokens (2 blocks of 4) carrying their engine's block hashes."""
    chain = make_chain([range(8 * i, 8 * i + 8) for i in range(num_chunks)])
    all_hashes = hashes(seed, 2 * num_chunks)
    return [
        (replace(meta, engine_block_hashes=all_hashes[2 * i : 2 * i + 2],
                 engine_parent_block_hash=all_hashes[2 * i - 1] if i else b""), payload)
        for i, (meta, payload) in enumerate(chain)
    ]  # fmt: skip


def state_after(batches: list[KvEventBatch]) -> set[int | bytes]:
    return held_after(event for batch in batches for event in batch.events)


# ---- the log: which events are due -----------------------------------------------------


def test_a_block_two_segments_hold_is_removed_with_the_last_of_them() -> None:
    (chunk, _), = engine_chain(1)  # fmt: skip
    tail = replace(
        make_meta(range(4), make_payload(256)), engine_block_hashes=chunk.engine_block_hashes[:1]
    )
    log = KvEventLog("bytes", 100)
    assert [type(e) for e in log.events([Cleared.CLEARED, chunk, tail])] == [
        AllBlocksCleared, BlockStored, BlockStored,
    ]  # fmt: skip
    assert log.events([(NAMESPACE, tail.context_key)]) == []  # the chunk holds it
    (removed,) = log.events([(NAMESPACE, chunk.context_key)])
    assert isinstance(removed, BlockRemoved)
    assert set(removed.block_hashes) == set(chunk.engine_block_hashes)
    assert log.held_hashes() == set()


def test_segments_without_engine_blocks_and_repeated_puts_say_nothing() -> None:
    (chunk, _), = engine_chain(1)  # fmt: skip
    plain = make_meta(range(3), make_payload(64))
    log = KvEventLog("int", 100)
    assert log.events([plain, (NAMESPACE, plain.context_key)]) == []
    assert len(log.events([chunk, chunk])) == 1


def test_stored_event_fields_match_the_segment() -> None:
    (_, _), (second, _) = engine_chain(2)
    (event,) = KvEventLog("int", 100).events([second])
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [external_hash(h, "int") for h in second.engine_block_hashes]
    assert event.parent_block_hash == external_hash(second.engine_parent_block_hash, "int")
    assert event.token_ids == list(second.token_ids) and event.block_size == BLOCK
    assert event.medium == "kvsplice"
    # vLLM's int form: the last 8 bytes, big-endian
    assert external_hash(b"\x01" * 24 + b"\x00" * 7 + b"\x05", "int") == 5


def test_replay_is_the_buffer_or_else_a_snapshot_of_what_is_held() -> None:
    chain = engine_chain(3)
    log = KvEventLog("bytes", buffer_steps=2)
    payloads = []
    for change in [chain[0][0], chain[1][0], chain[2][0],
                   (NAMESPACE, chain[1][0].context_key)]:  # fmt: skip
        payload = msgspec.msgpack.encode(KvEventBatch(0.0, log.events([change])))
        payloads.append(payload)
        log.published(payload)
    assert log.replay(2, ts=1.0) == [(2, payloads[2]), (3, payloads[3])]
    ((seq, snapshot),) = log.replay(0, ts=1.0)  # seq 0 and 1 fell out of the buffer
    assert seq == 3
    expected = {h for meta, _ in (chain[0], chain[2]) for h in meta.engine_block_hashes}
    assert state_after([DECODER.decode(snapshot)]) == expected == log.held_hashes()


# ---- the segment's engine blocks travel and rest with it ------------------------------


def test_engine_block_hashes_survive_the_header_and_the_record() -> None:
    _, (meta, _) = engine_chain(2)
    assert header_to_meta(meta_to_header(meta), keep_created_at=True) == meta
    assert decode_meta(encode_meta(meta)) == meta


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"engine_block_hashes": (b"\x01" * 32,) * 3}, "do not split 8 tokens"),
        ({"engine_block_hashes": (b"",) * 2}, "of 0 bytes"),
        ({"engine_parent_block_hash": b"\x01" * 32}, "without engine_block_hashes"),
    ],
)
def test_malformed_engine_blocks_are_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        replace(make_meta(range(8), make_payload(64)), **fields)


# ---- the publisher over ZMQ ---------------------------------------------------------------


@pytest.fixture
def publisher() -> Iterator[KvEventPublisher]:
    config = KvEventsConfig(
        endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="kv",
        block_hashes="bytes",
    )  # fmt: skip
    publisher = KvEventPublisher(config)
    yield publisher
    publisher.close()


def subscribe(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    time.sleep(0.2)  # the slow joiner: a SUB misses what is sent before it is connected
    return sub


def receive(sub: zmq.Socket, timeout_s: float = 1.0) -> tuple[int, KvEventBatch] | None:
    if not sub.poll(int(timeout_s * 1000)):
        return None
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv"
    return int.from_bytes(seq, "big"), DECODER.decode(payload)


def replay(endpoint: str, start_seq: int) -> list[tuple[int, KvEventBatch]]:
    """As vLLM's own tests ask: a DEALER (one request, many replies), an empty delimiter."""
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.connect(endpoint)
    req.send_multipart([b"", start_seq.to_bytes(8, "big")])
    batches = []
    while req.poll(2000):
        _, _, seq, payload = req.recv_multipart()
        if not payload:
            assert int.from_bytes(seq, "big", signed=True) == -1
            break
        batches.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    req.close(linger=0)
    return batches


def test_puts_deletes_and_expiry_reach_subscribers_within_a_second(
    publisher: KvEventPublisher,
) -> None:
    sub = subscribe(publisher.endpoint)
    service = make_service()
    service.add_index_watcher(publisher)
    chain = engine_chain(2)
    for meta, payload in chain:
        service.put(meta, payload)
    seen: list[KvEventBatch] = []
    while (got := receive(sub)) is not None and len(state_after([*seen, got[1]])) < 4:
        seen.append(got[1])
    assert got is not None
    seen.append(got[1])
    assert state_after(seen) == {h for meta, _ in chain for h in meta.engine_block_hashes}

    started = time.monotonic()
    service.delete(NAMESPACE, chain[1][0].context_key)
    got = receive(sub)
    assert got is not None and time.monotonic() - started < 1.0
    (removed,) = got[1].events
    assert isinstance(removed, BlockRemoved)
    assert set(removed.block_hashes) == set(chain[1][0].engine_block_hashes)


def test_a_late_subscriber_replays_what_the_index_holds(publisher: KvEventPublisher) -> None:
    service = make_service()
    service.add_index_watcher(publisher)
    chain = engine_chain(3)
    for meta, payload in chain:
        service.put(meta, payload)
    service.delete(NAMESPACE, chain[0][0].context_key)
    time.sleep(0.3)  # published (nobody listening)
    assert publisher.replay_endpoint is not None
    batches = replay(publisher.replay_endpoint, 0)
    assert batches[0][0] == 0 and isinstance(batches[0][1].events[0], AllBlocksCleared)
    held = {h for meta in service._store.iter_meta() for h in meta.engine_block_hashes}
    assert len(held) == 4 and state_after([batch for _, batch in batches]) == held


def test_an_endpoint_taken_is_refused_clearly(publisher: KvEventPublisher) -> None:
    from kvsplice.common.errors import ServeRefused

    with pytest.raises(ServeRefused, match="cannot bind KV events"):
        KvEventPublisher(KvEventsConfig(endpoint=publisher.endpoint))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"endpoint": "127.0.0.1:5557"}, "must be tcp://"),
        ({"endpoint": "tcp://x:1", "block_hashes": "hex"}, "block_hashes 'hex'"),
        ({"endpoint": "tcp://x:1", "batch_interval_s": 2.0}, "batch_interval_s"),
    ],
)
def test_bad_config_is_refused(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KvEventsConfig(**fields)


def test_a_served_sidecar_publishes_its_clients_puts_and_again_after_a_restart(
    tmp_path: Path,
) -> None:
    """`serve` wiring: hashes cross gRPC with the put, rest in LMDB, and a restarted sidecar
    opens its stream with AllBlocksCleared and what it rebuilt from its tiers."""
    from kvsplice.server.embedded import EmbeddedStore, loopback_config
    from kvsplice.storeclient.client import StoreClient

    config = KvEventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                            topic="kv", block_hashes="bytes")  # fmt: skip
    chain = engine_chain(2)
    expected = {h for meta, _ in chain for h in meta.engine_block_hashes}
    for attempt in ("first", "restarted"):
        with EmbeddedStore(loopback_config(str(tmp_path / "lmdb"), kv_events=config)) as store:
            if attempt == "first":
                with StoreClient(store.target, NAMESPACE) as client:
                    assert all(client.put_segment(meta, payload) for meta, payload in chain)
            publisher = store.server.kv_events
            assert publisher is not None and publisher.replay_endpoint is not None
            batches = [batch for _, batch in wait_replayed(publisher.replay_endpoint, expected)]
            assert isinstance(batches[0].events[0], AllBlocksCleared)
            assert state_after(batches) == expected, attempt


def wait_replayed(endpoint: str, expected: set[bytes]) -> list[tuple[int, KvEventBatch]]:
    deadline = time.monotonic() + 5.0
    while True:
        batches = replay(endpoint, 0)
        if state_after([batch for _, batch in batches]) == expected:
            return batches
        assert time.monotonic() < deadline, "the stream never held the puts"
        time.sleep(0.1)


def test_serve_flags_make_the_stream_s_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvsplice.cli import main
    from kvsplice.server.config import ServerConfig

    started: list[ServerConfig] = []
    monkeypatch.setattr("kvsplice.server.app.serve", started.append)
    base = ["serve", "--listen", "127.0.0.1:0", "--admin-listen", "off",
            "--lmdb-path", str(tmp_path / "lmdb")]  # fmt: skip
    for argv in (
        [],
        ["--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-block-hashes", "bytes"],
    ):
        with pytest.raises(SystemExit) as exited:
            main([*base, *argv])
        assert exited.value.code == 0
    off, on = started
    assert off.kv_events is None
    assert on.kv_events == KvEventsConfig(endpoint="tcp://127.0.0.1:0", block_hashes="bytes")
    KvEventPublisher(on.kv_events).close()  # what the defaults make, it builds
