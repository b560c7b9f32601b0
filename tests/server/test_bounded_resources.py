"""Bounded resources: a stalled upload is cut by the server, uploads in flight share one
byte budget (RESOURCE_EXHAUSTED past it), health checks are answered while a large put or
get is in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.store import make_meta, make_payload

from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc
from kvsplice.server.config import MIB, SegmentServiceConfig
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storeclient.wire import put_requests


def stalling_put(meta: object, release: threading.Event) -> Iterator[pb.PutSegmentRequest]:
    """A PutSegment stream that sends its header and one chunk, then goes silent."""
    requests = put_requests(meta, make_payload(meta.payload_nbytes), 64 * 1024)  # type: ignore[attr-defined]
    yield next(requests)
    yield next(requests)
    release.wait(30)


def put_status(target: str, requests: Iterator[pb.PutSegmentRequest]) -> grpc.StatusCode:
    with grpc.insecure_channel(target) as channel:
        try:
            store_pb2_grpc.SegmentStoreStub(channel).PutSegment(requests, timeout=30)
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_a_stalled_upload_is_cut_by_the_server(tmp_path: Path) -> None:
    config = loopback_config(None, stream_idle_timeout_s=0.5)
    release = threading.Event()
    with EmbeddedStore(config) as store:
        meta = make_meta([1, 2], make_payload(1 << 20))
        with grpc.insecure_channel(store.target) as channel, pytest.raises(grpc.RpcError) as caught:
            store_pb2_grpc.SegmentStoreStub(channel).PutSegment(
                stalling_put(meta, release), timeout=30
            )
        release.set()
        assert store._server is not None
        assert store._server.uploads.inflight_nbytes == 0
    # The server's cut, not the client's own 30 s deadline (its details say "Deadline Exceeded").
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cut by the server" in caught.value.details()


def test_uploads_in_flight_share_one_budget(tmp_path: Path) -> None:
    service = SegmentServiceConfig(max_payload_nbytes=1 * MIB)
    config = loopback_config(
        None, service=service, max_inflight_upload_nbytes=2 * MIB, stream_idle_timeout_s=20
    )
    release = threading.Event()
    with EmbeddedStore(config) as store:
        metas = [make_meta([i + 1], make_payload(MIB, seed=i)) for i in range(3)]
        codes: list[grpc.StatusCode] = []
        stalled = [
            threading.Thread(
                target=lambda m=m: codes.append(put_status(store.target, stalling_put(m, release)))
            )
            for m in metas[:2]
        ]
        for thread in stalled:
            thread.start()
        assert store._server is not None
        deadline = time.monotonic() + 10
        while store._server.uploads.inflight_nbytes < 2 * MIB:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        third = put_requests(metas[2], make_payload(MIB, seed=2), 64 * 1024)
        assert put_status(store.target, third) is grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        for thread in stalled:
            thread.join(30)
        assert (
            put_status(store.target, put_requests(metas[2], make_payload(MIB, seed=2), MIB // 2))
            is grpc.StatusCode.OK
        )
    # The stalled streams ended short of their declared size once released: refused too.
    assert codes == [grpc.StatusCode.DATA_LOSS, grpc.StatusCode.DATA_LOSS]


@pytest.mark.slow
def test_a_large_put_does_not_stall_health_checks(tmp_path: Path) -> None:
    payload = make_payload(32 * MIB)
    meta = make_meta([3, 1, 4, 1, 5], payload)
    statuses: list[int] = []
    with EmbeddedStore(loopback_config(str(tmp_path / "lmdb"), memory_bytes=128 * MIB)) as store:
        health_channel = grpc.insecure_channel(store.target)
        health = health_pb2_grpc.HealthStub(health_channel)

        def check() -> None:  # the 10 s timeout only keeps a stalled server from hanging CI
            statuses.append(health.Check(health_pb2.HealthCheckRequest(), timeout=10).status)

        def put_checked_halfway() -> Iterator[pb.PutSegmentRequest]:
            requests = list(put_requests(meta, payload, 4 * MIB))
            yield from requests[: len(requests) // 2]
            check()  # half the payload is with the server, the stream still open
            yield from requests[len(requests) // 2 :]

        with grpc.insecure_channel(
            store.target, options=[("grpc.max_receive_message_length", 8 * MIB)]
        ) as channel:
            stub = store_pb2_grpc.SegmentStoreStub(channel)
            stub.PutSegment(put_checked_halfway(), timeout=60)
            request = pb.GetSegmentRequest(namespace=meta.namespace, context_key=meta.context_key)
            replies = stub.GetSegment(request, timeout=60)
            received = [next(replies), next(replies)]
            check()  # the read stream open mid-payload
            received += list(replies)
        health_channel.close()
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert b"".join(r.chunk for r in received[1:]) == payload


def test_a_reader_that_stops_reading_is_cut_by_the_server() -> None:
    payload = make_payload(32 * MIB)
    meta = make_meta([2, 7, 1, 8], payload)
    service = SegmentServiceConfig(max_anchor_nbytes=256 * 1024)
    config = loopback_config(
        None, stream_idle_timeout_s=0.5, chunk_nbytes=256 * 1024, service=service
    )
    with EmbeddedStore(config) as store:
        assert (
            put_status(store.target, put_requests(meta, payload, 256 * 1024)) is grpc.StatusCode.OK
        )
        with grpc.insecure_channel(store.target) as channel:
            request = pb.GetSegmentRequest(namespace=meta.namespace, context_key=meta.context_key)
            replies = store_pb2_grpc.SegmentStoreStub(channel).GetSegment(request, timeout=30)
            next(replies)  # the header, then nothing read for a while
            time.sleep(3)
            with pytest.raises(grpc.RpcError) as caught:
                for _ in replies:
                    pass
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        # A reader that keeps reading gets the whole segment.
        with grpc.insecure_channel(store.target) as channel:
            replies = list(store_pb2_grpc.SegmentStoreStub(channel).GetSegment(request, timeout=30))
        assert b"".join(r.chunk for r in replies[1:]) == payload


def test_a_stalled_anchor_upload_is_cut_by_the_server() -> None:
    release = threading.Event()

    def stalling_anchor() -> Iterator[pb.PutAnchorRequest]:
        yield pb.PutAnchorRequest(
            namespace="tenant-a", model_fingerprint="kvfp1-" + "0" * 32, placeholder_id="p",
            anchor_id="a", base_payload=b"x" * 1024, num_tokens=4,
        )  # fmt: skip
        release.wait(30)

    with EmbeddedStore(loopback_config(None, stream_idle_timeout_s=0.5)) as store:
        with grpc.insecure_channel(store.target) as channel, pytest.raises(grpc.RpcError) as caught:
            store_pb2_grpc.SegmentStoreStub(channel).PutAnchor(stalling_anchor(), timeout=30)
        release.set()
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cut by the server" in caught.value.details()
