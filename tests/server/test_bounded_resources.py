"""Bounded resources: a stalled upload is cut by the server, uploads in flight share one
byte budget (RESOURCE_EXHAUSTED past it), a large put does not stall health checks."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from store_factories import make_meta, make_payload

from kvsplice.client.store.store_wire import put_requests
from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc
from kvsplice.server.config import MIB, SegmentServiceConfig
from kvsplice.server.embedded import EmbeddedStore, loopback_config


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
        started = time.monotonic()
        code = put_status(store.target, stalling_put(meta, release))
        elapsed_s = time.monotonic() - started
        release.set()
        assert store._server is not None
        assert store._server.uploads.inflight_nbytes == 0
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed_s < 5


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
    latencies_s: list[float] = []
    with EmbeddedStore(loopback_config(str(tmp_path / "lmdb"), memory_bytes=128 * MIB)) as store:
        done = threading.Event()

        def probe() -> None:
            with grpc.insecure_channel(store.target) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                while not done.is_set():
                    started = time.perf_counter()
                    health.Check(health_pb2.HealthCheckRequest(), timeout=10)
                    latencies_s.append(time.perf_counter() - started)
                    time.sleep(0.01)

        prober = threading.Thread(target=probe)
        prober.start()
        time.sleep(0.2)
        for _ in range(2):
            put_status(store.target, put_requests(meta, payload, 4 * MIB))
            list_request = pb.GetSegmentRequest(
                namespace=meta.namespace, context_key=meta.context_key
            )
            with grpc.insecure_channel(
                store.target, options=[("grpc.max_receive_message_length", 8 * MIB)]
            ) as channel:
                list(store_pb2_grpc.SegmentStoreStub(channel).GetSegment(list_request, timeout=30))
        done.set()
        prober.join()
    assert max(latencies_s) < 1.0, max(latencies_s)


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
        with grpc.insecure_channel(store.target) as channel:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                store_pb2_grpc.SegmentStoreStub(channel).PutAnchor(stalling_anchor(), timeout=30)
            elapsed_s = time.monotonic() - started
        release.set()
    assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert elapsed_s < 5
