"""KV events of a real engine and the sidecar, read as a router reads them: vLLM's own event
classes and decoder on engine `a`'s stream (`--kv-events-config`) and the sidecar's
(`--kv-events-endpoint`). Collected by `test_connector_engines` (its engines, started once).

Oracle: the block hashes vLLM's scheduler computed for the prompt, as engine `a`'s block pool
publishes them (medium GPU). The connector's events and the sidecar's must name the same
blocks; a delete must be a `BlockRemoved` within 1 s; a late subscriber's replay must hold
what the sidecar's index holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import msgspec
import zmq
from conftest import NAMESPACE, KvEventEndpoints
from helpers.kv_event_state import held_after
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvsplice.common.keys import chunk_links
from kvsplice.eval.bench.vllm.engine import Engine, Sidecar

BLOCK = 128
DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
PROMPT = [1000 + (i * 7919) % 20000 for i in range(400)]  # 3 full blocks no other test sends
Event = BlockStored | BlockRemoved | AllBlocksCleared


class Subscriber:
    """A SUB on one publisher, decoding with vLLM's classes; `events` is all it has read."""

    def __init__(self, endpoint: str, topic: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.events: list[Event] = []

    def read_until(self, done: Callable[[list[Event]], bool], timeout_s: float) -> None:
        """Read until `done(events)` holds (AssertionError past `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while not done(self.events):
            left = deadline - time.monotonic()
            seen = [(type(e).__name__, getattr(e, "block_hashes", None)) for e in self.events]
            assert left > 0, f"no such events within {timeout_s} s; got {seen[-8:]}"
            if self.sock.poll(int(min(left, 0.5) * 1000)):  # `done` may act meanwhile
                self.events += DECODER.decode(self.sock.recv_multipart()[2]).events


def block_hashes(events: list[Event], kvsplice: bool) -> dict[tuple[int, ...], int | bytes]:
    """Each stored block's tokens -> its hash, from the kvsplice-medium events or the others."""
    found = {}
    for e in events:
        if isinstance(e, BlockStored) and (e.medium == "kvsplice") == kvsplice:
            for i, block_hash in enumerate(e.block_hashes):
                found[tuple(e.token_ids[i * e.block_size : (i + 1) * e.block_size])] = block_hash
    return found


def prompt_blocks() -> list[tuple[int, ...]]:
    return [tuple(PROMPT[i : i + BLOCK]) for i in range(0, 3 * BLOCK, BLOCK)]


def replayed_state(endpoint: str) -> set[int | bytes]:
    """What a router that starts now holds after replaying from sequence 0 (vLLM's DEALER)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    events: list[Event] = []
    while dealer.poll(5000):
        _, _, _, payload = dealer.recv_multipart()
        if not payload:
            break
        events += DECODER.decode(payload).events
    dealer.close(linger=0)
    return held_after(events)


def num_engine_blocks_held(sidecar: Sidecar) -> int:
    """Blocks of exact segments in every namespace (one block each: chunks of one block)."""
    rows = httpx.get(f"{sidecar.admin_url}/v1/stats", timeout=30.0).json()["namespaces"]
    return sum(
        s["num_tokens"] // BLOCK
        for row in rows
        for s in sidecar.segments(row["namespace"])
        if s["exact"]
    )


def test_kv_events_name_what_the_sidecar_holds_in_vllms_words(
    engines: dict[str, Engine], sidecar: Sidecar, kv_events: KvEventEndpoints
) -> None:
    from test_connector_engines import engine_fingerprint_of

    engine_stream = Subscriber(kv_events.engine.replace("*", "127.0.0.1"), kv_events.topic)
    store_stream = Subscriber(kv_events.sidecar, kv_events.topic)
    time.sleep(0.5)  # ZMQ's slow joiner: connected before anything is sent
    engines["a"].complete(PROMPT, max_tokens=1)
    blocks = prompt_blocks()
    engine_stream.read_until(lambda ev: set(blocks) <= set(block_hashes(ev, False)), 30.0)
    expected = [block_hashes(engine_stream.events, kvsplice=False)[b] for b in blocks]
    store_stream.read_until(lambda ev: set(blocks) <= set(block_hashes(ev, True)), 60.0)
    assert [block_hashes(store_stream.events, kvsplice=True)[b] for b in blocks] == expected
    parents = {tuple(e.token_ids): e.parent_block_hash for e in store_stream.events
               if isinstance(e, BlockStored) and tuple(e.token_ids) in blocks}  # fmt: skip
    assert [parents[b] for b in blocks] == [None, *expected[:2]]

    def acknowledged(ev: list[Event]) -> bool:
        engines["a"].complete([7, 8, 9], max_tokens=2)  # a step: the acknowledgements flow
        return set(blocks) <= set(block_hashes(ev, kvsplice=True))

    engine_stream.read_until(acknowledged, 60.0)  # the connector's take_events, via vLLM
    assert [block_hashes(engine_stream.events, kvsplice=True)[b] for b in blocks] == expected

    last = chunk_links(engine_fingerprint_of(engines["a"]), PROMPT, BLOCK)[2].key.hex()
    start = time.monotonic()
    deleted = httpx.delete(
        f"{sidecar.admin_url}/v1/segments/{last}", params={"namespace": NAMESPACE}, timeout=30.0
    )
    assert deleted.json()["deleted"]
    store_stream.read_until(
        lambda ev: any(isinstance(e, BlockRemoved) and expected[2] in e.block_hashes for e in ev),
        5.0,
    )
    took_s = time.monotonic() - start  # the admin call's round trip included
    assert took_s < 1.0, f"BlockRemoved {took_s:.2f} s after the delete"

    held = replayed_state(kv_events.sidecar_replay)
    assert set(expected[:2]) <= held and expected[2] not in held
    assert len(held) == num_engine_blocks_held(sidecar)
