"""AsyncStoreClient: the same results, faults and misses as the sync client, under asyncio."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from store_client_factories import (
    FINGERPRINT,
    NAMESPACE,
    OTHER_FINGERPRINT,
    closed_port_target,
    fake_store,
    make_meta,
    make_payload,
)

from kvsplice.client.async_store_client import AsyncStoreClient
from kvsplice.client.store_config import StoreClientConfig
from kvsplice.client.store_types import PrefixLookup
from kvsplice.client.store_wire import meta_to_header
from kvsplice.common.errors import FingerprintMismatch, InvalidRequest
from kvsplice.proto import store_pb2 as pb
from kvsplice.server.embedded import EmbeddedStore, loopback_config

FAULT_LOGGER = "kvsplice.client.store_faults"
# Generous deadlines where a slow shared CI box must not turn answers into misses.
PATIENT = StoreClientConfig(lookup_timeout_s=30.0, get_timeout_s=30.0, put_timeout_s=30.0)
FAST = StoreClientConfig(
    lookup_timeout_s=0.3, get_timeout_s=0.5, put_timeout_s=0.5, warn_interval_s=60.0
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EmbeddedStore]:
    with EmbeddedStore(loopback_config(str(tmp_path))) as embedded:
        yield embedded


async def test_round_trip_lookups_anchors_and_stats(store: EmbeddedStore) -> None:
    payload = make_payload(5 << 20)
    meta = make_meta(range(40), payload)
    async with AsyncStoreClient(store.target, NAMESPACE, config=PATIENT) as client:
        assert await client.put_segment(meta, payload) is True
        got = await client.get_segment(meta.segment_id, model_fingerprint=FINGERPRINT)
        assert got is not None and got[1] == payload
        assert replace(got[0], created_at_s=0.0) == meta
        match = await client.lookup_prefix(FINGERPRINT, list(range(45)))
        assert match.num_matched_tokens == 40
        assert [
            c.segment.segment_id for c in await client.find_similar(FINGERPRINT, list(range(40)))
        ] == [meta.segment_id]
        assert await client.put_anchor(FINGERPRINT, "q", "a1", b"base", {"judge": b"o"}, 3) == []
        assert await client.touch_anchors(FINGERPRINT, "q", ["a1"]) == 1
        (anchor,) = await client.get_anchors(FINGERPRINT, "q")
        assert (anchor.activation_count, dict(anchor.agent_payloads)) == (1, {"judge": b"o"})
        assert (await client.stats()).num_segments == 1  # type: ignore[union-attr]
        assert await client.delete(meta.segment_id) is True
        assert await client.get_segment(meta.segment_id) is None


async def test_server_faults_raise_our_errors(store: EmbeddedStore) -> None:
    payload = make_payload(100)
    meta = make_meta([1, 2, 3], payload)
    async with AsyncStoreClient(store.target, NAMESPACE, config=PATIENT) as client:
        await client.put_segment(meta, payload)
        with pytest.raises(FingerprintMismatch):
            await client.get_segment(meta.segment_id, model_fingerprint=OTHER_FINGERPRINT)
        with pytest.raises(InvalidRequest):
            await client.lookup_prefix(FINGERPRINT, [2**31])


async def test_unreachable_store_gives_misses_and_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    payload = make_payload(100)
    meta = make_meta([1, 2], payload)
    async with AsyncStoreClient(closed_port_target(), NAMESPACE, config=FAST) as client:
        started = time.monotonic()
        results = [
            await client.put_segment(meta, payload),
            await client.get_segment(meta.segment_id),
            await client.lookup_prefix(FINGERPRINT, [1, 2]),
            await client.find_similar(FINGERPRINT, [1, 2]),
            await client.stats(),
        ]
        elapsed_s = time.monotonic() - started
    assert results == [False, None, PrefixLookup.MISS, [], None]
    assert elapsed_s < 5 * FAST.get_timeout_s
    assert client.counters.num_degraded_calls == 5
    assert (
        len([r for r in caplog.records if r.name == FAULT_LOGGER and r.levelno == logging.WARNING])
        == 1
    )


async def test_a_payload_failing_its_checksum_is_a_counted_miss() -> None:
    payload = make_payload(1000)
    header = meta_to_header(make_meta([1, 2], payload))

    def truncated_get(
        request: pb.GetSegmentRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GetSegmentResponse]:
        yield pb.GetSegmentResponse(header=header)
        yield pb.GetSegmentResponse(chunk=payload[:500])

    with fake_store(GetSegment=("server_stream", truncated_get)) as target:
        async with AsyncStoreClient(target, NAMESPACE, config=FAST) as client:
            assert await client.get_segment("00" * 16) is None
            assert client.counters.num_corrupt_payloads == 1


async def test_sixteen_concurrent_tasks_never_mix_up_payloads(store: EmbeddedStore) -> None:
    async with AsyncStoreClient(store.target, NAMESPACE, config=PATIENT) as client:

        async def task(task_id: int) -> None:
            for round_id in range(3):
                payload = make_payload(
                    8192 + 1024 * task_id + round_id, seed=task_id * 10 + round_id
                )
                tokens = [task_id * 1000 + round_id * 10 + i for i in range(6)]
                meta = make_meta(tokens, payload)
                assert await client.put_segment(meta, payload) is True
                got = await client.get_segment(meta.segment_id)
                assert got is not None and got[1] == payload
                match = await client.lookup_prefix(FINGERPRINT, tokens)
                assert [s.segment_id for s in match.segments] == [meta.segment_id]

        await asyncio.gather(*(task(i) for i in range(16)))
        assert (await client.stats()).num_segments == 48  # type: ignore[union-attr]
        assert client.counters.num_degraded_calls == 0
