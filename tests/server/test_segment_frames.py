"""The chunk-frame path of the server (`add_to_server`): same bytes on the wire as the
generated registration, so protobuf clients and the frame-speaking clients both work."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import replace

import grpc
import pytest
from grpc import aio
from helpers.store import NAMESPACE, make_meta, make_payload, make_service, make_store

from kvsplice.common.errors import CorruptPayload
from kvsplice.common.segment import SegmentMeta
from kvsplice.index.anchor_pool import AnchorPoolConfig
from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc
from kvsplice.proto.segment_stream import encode_chunk
from kvsplice.server import convert
from kvsplice.server.anchor_service import AnchorService
from kvsplice.server.config import SegmentServiceConfig
from kvsplice.server.interceptors import FaultInterceptor
from kvsplice.server.metrics import StoreMetrics
from kvsplice.server.servicer import RPC_METHODS, SegmentStoreServicer, add_to_server
from kvsplice.storage.tiered_store import StoredSegment
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig
from kvsplice.storeclient.wire import put_frames, put_requests

CHUNK_NBYTES = 64 * 1024
CLIENT_CONFIG = StoreClientConfig(chunk_nbytes=CHUNK_NBYTES, get_timeout_s=30, put_timeout_s=30)


async def _stream(parts: Iterable[convert.PutPart]) -> AsyncIterator[convert.PutPart]:
    for part in parts:
        yield part


async def test_parsed_frames_reassemble_into_the_payload() -> None:
    payload = make_payload(5 * 1000 + 7)
    meta = make_meta([1, 2, 3], payload)
    parts = [convert.parse_put_request(f) for f in put_frames(meta, payload, 1000)]
    assert isinstance(parts[0], pb.PutSegmentRequest) and isinstance(parts[1], memoryview)
    received_meta, received = await convert.receive_segment(_stream(parts), lambda m: m)
    assert bytes(received) == payload and received_meta.context_key == meta.context_key


async def test_frames_past_the_declared_size_are_refused() -> None:
    payload = make_payload(100)
    meta = make_meta([1, 2], payload)
    frames = [*put_frames(meta, payload, 60), encode_chunk(b"x")]
    with pytest.raises(CorruptPayload, match="exceeds"):
        await convert.receive_segment(_stream(map(convert.parse_put_request, frames)), lambda m: m)


def test_segment_frames_are_the_serialized_responses() -> None:
    payload = make_payload(2500)
    stored = StoredSegment(make_meta([1], payload), memoryview(payload))
    expected = [pb.GetSegmentResponse(header=convert.meta_to_header(stored.meta))] + [
        pb.GetSegmentResponse(chunk=payload[start : start + 1000]) for start in (0, 1000, 2000)
    ]  # what protobuf objects would serialize to
    expected = [r.SerializeToString() for r in expected]
    assert list(convert.segment_frames(stored, 1000)) == expected


@asynccontextmanager
async def frames_server() -> AsyncIterator[str]:
    """The store servicer on loopback, registered by `add_to_server`, behind the fault interceptor."""
    store = make_store()
    config = SegmentServiceConfig()
    metrics = StoreMetrics(RPC_METHODS)
    anchors = AnchorService(store, AnchorPoolConfig(), config)
    servicer = SegmentStoreServicer(make_service(store, config), anchors, metrics, CHUNK_NBYTES)
    server = aio.server(interceptors=[FaultInterceptor(metrics)])
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
        store.close()


async def test_protobuf_clients_round_trip_through_the_frame_path() -> None:
    payload = make_payload(3 * CHUNK_NBYTES + 5)
    meta = make_meta(range(40), payload)
    async with frames_server() as target, aio.insecure_channel(target) as channel:
        stub = store_pb2_grpc.SegmentStoreStub(channel)
        await stub.PutSegment(put_requests(meta, payload, CHUNK_NBYTES), timeout=30)
        request = pb.GetSegmentRequest(namespace=NAMESPACE, context_key=meta.context_key)
        responses = [r async for r in stub.GetSegment(request, timeout=30)]
    assert responses[0].WhichOneof("part") == "header"
    assert b"".join(r.chunk for r in responses[1:]) == payload


async def test_frame_clients_round_trip_and_miss_through_the_frame_path() -> None:
    payload = make_payload(3 * CHUNK_NBYTES + 5, seed=1)
    meta = make_meta(range(50), payload)
    async with frames_server() as target:
        # the sync client on a thread: the server runs on this test's event loop
        stored, got, missing = await asyncio.to_thread(_put_get_miss, target, meta, payload)
    assert stored
    assert got is not None and got[1] == payload and got[0].context_key == meta.context_key
    assert missing is None


def _put_get_miss(target: str, meta: SegmentMeta, payload: bytes) -> tuple:
    with StoreClient(target, NAMESPACE, config=CLIENT_CONFIG) as client:
        stored = client.put_segment(meta, payload)
        return stored, client.get_segment(meta.context_key), client.get_segment(b"\x00" * 16)


async def test_a_bad_checksum_is_still_data_loss_on_the_frame_path() -> None:
    payload = make_payload(1000)
    meta = replace(make_meta([5, 6, 7], payload), checksum=1)
    async with frames_server() as target, aio.insecure_channel(target) as channel:
        stub = store_pb2_grpc.SegmentStoreStub(channel)
        with pytest.raises(aio.AioRpcError) as info:
            await stub.PutSegment(put_requests(meta, payload, 300), timeout=30)
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
