"""The connector's `take_events`: vLLM `BlockStored` for the chunks the sidecar acknowledged,
with the block hashes vLLM's own block pool publishes for those tokens (the oracle: a real
`BlockPool` with KV events on, caching the same real `Request`), and the same hashes on
the chunks' saves. Nothing for a chunk not acknowledged, failed, or off-chain."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pytest
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

from kvsplice.integrations.vllm.connector_config import ConnectorConfig
from kvsplice.integrations.vllm.scheduler_side import SchedulerSide
from kvsplice.integrations.vllm.transfer_specs import SaveSpec, WorkerNews
from kvsplice.storeclient.results import PrefixLookup

FINGERPRINT = "kvfp1-" + "cd" * 16
BLOCK, CHUNK = 4, 8
PROMPT = list(range(100, 118))  # 18 tokens: chunks [0, 8) and [8, 16)


class MissingStore:
    counters = SimpleNamespace(num_degraded_calls=0, num_corrupt_payloads=0)

    def lookup_prefix(self, fingerprint: str, token_ids: list[int]) -> PrefixLookup:
        return PrefixLookup.MISS


class Clients:
    config = ConnectorConfig("h:1", namespace="ns")

    def for_namespace(self, namespace: str) -> MissingStore:
        return MissingStore()


def make_request(salt: str | None = "salt") -> Request:
    init_none_hash(sha256)
    return Request(
        "r", PROMPT, SamplingParams(max_tokens=1), None, cache_salt=salt,
        block_hasher=get_request_block_hasher(BLOCK, sha256), session_id="planner-1",
    )  # fmt: skip


def vllms_event(request: Request) -> BlockStored:
    """What vLLM's block pool publishes when it caches the request's 4 full blocks."""
    pool = BlockPool(16, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(4), 0, 4, BLOCK, 0)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    return event


def planned_saves(
    request: Request, fence_at: int | None = None
) -> tuple[SchedulerSide, list[SaveSpec]]:
    side = SchedulerSide(Clients(), FINGERPRINT, BLOCK, CHUNK, lookup_wait_s=10.0)  # type: ignore[arg-type]
    assert side.num_new_matched_tokens(request, 0) == 0  # a miss: all of it is computed
    if fence_at is not None:
        side._tracked["r"].fence.place(request, fence_at, BLOCK)  # approximate from there
    new = SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4, 5],), num_computed_tokens=0)
    step = SimpleNamespace(
        scheduled_new_reqs=[new], num_scheduled_tokens={"r": len(PROMPT)},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]), scheduled_spec_decode_tokens={},
    )  # fmt: skip
    _, saves, _ = side.build_step(step)
    return side, saves


def keys(specs: list[SaveSpec]) -> list[tuple[str, bytes]]:
    return [(s.namespace, s.key) for s in specs]


def test_acknowledged_chunks_yield_vllms_block_stored_with_its_hashes() -> None:
    request = make_request()
    oracle = vllms_event(request)
    side, saves = planned_saves(request)
    assert [(s.start, s.end) for s in saves] == [(0, 8), (8, 16)]
    assert side.events.take() == []  # nothing acknowledged yet
    side.absorb(WorkerNews(acked=keys(saves)))
    first, second = side.events.take()
    assert first.block_hashes + second.block_hashes == oracle.block_hashes
    assert first.parent_block_hash is None
    assert second.parent_block_hash == oracle.block_hashes[1]
    assert first.token_ids + second.token_ids == oracle.token_ids == PROMPT[:16]
    assert first.extra_keys + second.extra_keys == oracle.extra_keys  # the salt, block 0
    for event in (first, second):
        assert (event.block_size, event.group_idx, event.session_id) == (BLOCK, 0, "planner-1")
        assert (event.lora_id, event.lora_name, event.medium) == (None, None, "kvsplice")
    assert side.events.take() == []  # each once
    batch = KVEventBatch(ts=1.0, events=[first, second])  # what vLLM's publisher sends
    decoded = msgspec.msgpack.Decoder(type=KVEventBatch).decode(msgspec.msgpack.encode(batch))
    assert decoded.events == [first, second]


def test_the_saves_carry_the_same_hashes_to_the_sidecar() -> None:
    request = make_request(salt=None)
    oracle = vllms_event(request)
    _, saves = planned_saves(request)
    sent = [maybe_convert_block_hash(h) for s in saves for h in s.block_hashes]
    assert sent == oracle.block_hashes
    assert saves[0].parent_block_hash == b""
    assert maybe_convert_block_hash(saves[1].parent_block_hash) == oracle.block_hashes[1]


@pytest.mark.parametrize("news", ["failed", "unanswered"])
def test_a_chunk_not_acknowledged_yields_nothing(news: str) -> None:
    side, saves = planned_saves(make_request())
    side.absorb(
        WorkerNews(acked=keys(saves[:1]), failed=keys(saves[1:]) if news == "failed" else [])
    )
    (event,) = side.events.take()
    assert event.token_ids == PROMPT[:8]
    side.absorb(WorkerNews(acked=keys(saves[1:])))  # a late answer to a failed put: stale
    assert len(side.events.take()) == (0 if news == "failed" else 1)


def test_an_off_chain_chunk_carries_no_hashes_and_yields_nothing() -> None:
    side, saves = planned_saves(make_request(), fence_at=CHUNK)
    exact, off_chain = saves[0], saves[-1]
    assert exact.exact and exact.block_hashes and not off_chain.exact
    assert off_chain.block_hashes == () and off_chain.parent_block_hash == b""
    side.absorb(WorkerNews(acked=keys(saves)))
    assert [e.token_ids for e in side.events.take()] == [PROMPT[:8]]
