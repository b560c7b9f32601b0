"""The gRPC server end to end (embedded, raw stubs): each fault gets a clear status, the
server stays up, nothing acknowledged is lost (restart, drain on shutdown)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers.store import (
    FINGERPRINT,
    NAMESPACE,
    OTHER_FINGERPRINT,
    make_chain,
    make_meta,
    make_payload,
)

from kvsplice.common.segment import SegmentMeta
from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc
from kvsplice.server.config import SegmentServiceConfig
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.server.servicer import SERVICE_NAME
from kvsplice.storeclient.wire import meta_to_header, put_requests

TOKEN = "s3cret-token"
CHUNK_NBYTES = 64 * 1024
# The raw test channel may send more than the server accepts, to test the server's limit.
SERVICE_CONFIG = SegmentServiceConfig(max_segment_tokens=4096, max_anchor_nbytes=512 * 1024)
RAW_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
]


def start_store(lmdb_dir: Path, **overrides: object) -> EmbeddedStore:
    config = loopback_config(
        str(lmdb_dir),
        chunk_nbytes=CHUNK_NBYTES,
        service=SERVICE_CONFIG,
        **overrides,
    )
    store = EmbeddedStore(config)
    store.start()
    return store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EmbeddedStore]:
    embedded = start_store(tmp_path / "lmdb")
    yield embedded
    embedded.stop()


@pytest.fixture
def stub(store: EmbeddedStore) -> Iterator[store_pb2_grpc.SegmentStoreStub]:
    with grpc.insecure_channel(store.target, options=RAW_OPTIONS) as channel:
        yield store_pb2_grpc.SegmentStoreStub(channel)


def put(
    stub: store_pb2_grpc.SegmentStoreStub, meta: SegmentMeta, payload: bytes, **kwargs: object
) -> None:
    stub.PutSegment(put_requests(meta, payload, CHUNK_NBYTES), timeout=5, **kwargs)


def get(stub: store_pb2_grpc.SegmentStoreStub, meta: SegmentMeta, fingerprint: str = "") -> bytes:
    request = pb.GetSegmentRequest(
        namespace=meta.namespace, context_key=meta.context_key, model_fingerprint=fingerprint
    )
    responses = list(stub.GetSegment(request, timeout=5))
    return b"".join(r.chunk for r in responses[1:])


def status_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value.code()


def assert_still_serving(stub: store_pb2_grpc.SegmentStoreStub) -> None:
    payload = make_payload(1000, seed=99)
    meta = make_meta([42, 43], payload)
    put(stub, meta, payload)
    assert get(stub, meta) == payload


def test_put_get_round_trip_spans_many_chunks(stub: store_pb2_grpc.SegmentStoreStub) -> None:
    payload = make_payload(5 * CHUNK_NBYTES + 17)
    meta = make_meta(range(100), payload)
    put(stub, meta, payload)
    assert get(stub, meta, FINGERPRINT) == payload


def _raw_stream(meta: SegmentMeta, payload: bytes, kind: str) -> list[pb.PutSegmentRequest]:
    header = pb.PutSegmentRequest(header=meta_to_header(meta))
    chunk = pb.PutSegmentRequest(chunk=payload)
    return {
        "no header": [chunk],
        "chunk before header": [chunk, header],
        "bytes short of payload_nbytes": [header, pb.PutSegmentRequest(chunk=payload[:-1])],
        "bytes beyond payload_nbytes": [header, chunk, pb.PutSegmentRequest(chunk=b"x")],
        "stream ends after header": [header],
    }[kind]


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        ("no header", grpc.StatusCode.INVALID_ARGUMENT),
        ("chunk before header", grpc.StatusCode.INVALID_ARGUMENT),
        ("bytes short of payload_nbytes", grpc.StatusCode.DATA_LOSS),
        ("bytes beyond payload_nbytes", grpc.StatusCode.DATA_LOSS),
        ("stream ends after header", grpc.StatusCode.DATA_LOSS),
    ],
)
def test_malformed_put_streams_get_a_clear_status(
    stub: store_pb2_grpc.SegmentStoreStub, kind: str, code: grpc.StatusCode
) -> None:
    payload = make_payload(300)
    meta = make_meta([5, 6, 7], payload)
    assert (
        status_of(lambda: stub.PutSegment(iter(_raw_stream(meta, payload, kind)), timeout=5))
        == code
    )
    assert status_of(lambda: get(stub, meta)) == grpc.StatusCode.NOT_FOUND  # nothing half-stored
    assert_still_serving(stub)


def test_checksum_mismatch_on_put_is_data_loss(stub: store_pb2_grpc.SegmentStoreStub) -> None:
    payload = make_payload(300)
    meta = replace(make_meta([5, 6, 7], payload), checksum=1)
    assert status_of(lambda: put(stub, meta, payload)) == grpc.StatusCode.DATA_LOSS


def test_oversize_messages_and_token_lists_are_refused(
    stub: store_pb2_grpc.SegmentStoreStub,
) -> None:
    payload = make_payload(10)
    too_long_for_a_message = replace(make_meta([1], payload), index_text="x" * (2 << 20))
    assert (
        status_of(lambda: put(stub, too_long_for_a_message, payload))
        == grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    too_many_tokens = make_meta(range(4097), payload)  # fits a message, not the service limit
    assert (
        status_of(lambda: put(stub, too_many_tokens, payload)) == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert_still_serving(stub)


@pytest.mark.parametrize(
    "request_",
    [
        pb.LookupPrefixRequest(model_fingerprint=FINGERPRINT, token_ids=[1]),  # no namespace
        pb.LookupPrefixRequest(namespace="a b", model_fingerprint=FINGERPRINT, token_ids=[1]),
        pb.LookupPrefixRequest(namespace=NAMESPACE, model_fingerprint="gpt", token_ids=[1]),
        pb.LookupPrefixRequest(
            namespace=NAMESPACE, model_fingerprint=FINGERPRINT, token_ids=[1, -1]
        ),
        pb.LookupPrefixRequest(
            namespace=NAMESPACE, model_fingerprint=FINGERPRINT, token_ids=[2**31]
        ),
    ],
)
def test_bad_lookups_are_invalid_arguments(
    stub: store_pb2_grpc.SegmentStoreStub, request_: pb.LookupPrefixRequest
) -> None:
    assert (
        status_of(lambda: stub.LookupPrefix(request_, timeout=5))
        == grpc.StatusCode.INVALID_ARGUMENT
    )


def test_every_rpc_requires_a_namespace(stub: store_pb2_grpc.SegmentStoreStub) -> None:
    key = b"\x00" * 16
    calls = [
        lambda: list(stub.GetSegment(pb.GetSegmentRequest(context_key=key), timeout=5)),
        lambda: stub.FindSimilar(
            pb.FindSimilarRequest(model_fingerprint=FINGERPRINT, token_ids=[1]), timeout=5
        ),
        lambda: list(
            stub.GetAnchors(
                pb.GetAnchorsRequest(model_fingerprint=FINGERPRINT, placeholder_id="p"), timeout=5
            )
        ),
        lambda: stub.DescribeDataPlane(pb.DescribeDataPlaneRequest(), timeout=5),
        lambda: stub.Delete(pb.DeleteRequest(context_key=key), timeout=5),
        lambda: stub.Stats(pb.StatsRequest(), timeout=5),
    ]
    for call in calls:
        assert status_of(call) == grpc.StatusCode.INVALID_ARGUMENT


def test_fingerprint_mismatch_on_get_is_failed_precondition(
    stub: store_pb2_grpc.SegmentStoreStub,
) -> None:
    payload = make_payload(100)
    meta = make_meta([1, 2], payload)
    put(stub, meta, payload)
    assert (
        status_of(lambda: get(stub, meta, OTHER_FINGERPRINT)) == grpc.StatusCode.FAILED_PRECONDITION
    )
    other = stub.LookupPrefix(
        pb.LookupPrefixRequest(
            namespace=NAMESPACE, model_fingerprint=OTHER_FINGERPRINT, token_ids=[1, 2]
        ),
        timeout=5,
    )
    assert other.num_matched_tokens == 0  # another model's chain never matches


def test_oversize_anchor_is_an_invalid_argument(stub: store_pb2_grpc.SegmentStoreStub) -> None:
    request = pb.PutAnchorRequest(
        namespace=NAMESPACE,
        model_fingerprint=FINGERPRINT,
        placeholder_id="p",
        anchor_id="a",
        base_payload=b"x" * (SERVICE_CONFIG.max_anchor_nbytes + 1),
        num_tokens=3,
    )
    status = status_of(lambda: stub.PutAnchor(iter([request]), timeout=5))
    assert status == grpc.StatusCode.INVALID_ARGUMENT


def test_health_and_reflection_are_served(store: EmbeddedStore) -> None:
    with grpc.insecure_channel(store.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(reflection.ServerReflectionInfo(iter([request]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


def test_with_a_token_configured_only_bearers_of_it_get_in(tmp_path: Path) -> None:
    embedded = start_store(tmp_path, auth_token=TOKEN)
    try:
        with grpc.insecure_channel(embedded.target) as channel:
            stub = store_pb2_grpc.SegmentStoreStub(channel)
            request = pb.StatsRequest(namespace=NAMESPACE)
            assert (
                status_of(lambda: stub.Stats(request, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
            )
            wrong = (("authorization", "Bearer nope"),)
            assert (
                status_of(lambda: stub.Stats(request, timeout=5, metadata=wrong))
                == grpc.StatusCode.UNAUTHENTICATED
            )
            payload = make_payload(10)
            streamed = lambda: put(stub, make_meta([1], payload), payload)  # noqa: E731
            assert status_of(streamed) == grpc.StatusCode.UNAUTHENTICATED
            right = (("authorization", f"Bearer {TOKEN}"),)
            assert stub.Stats(request, timeout=5, metadata=right).num_segments == 0
            health = health_pb2_grpc.HealthStub(channel)  # probes need no token
            assert (
                health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )
    finally:
        embedded.stop()


def test_client_cancelling_mid_stream_leaves_no_partial_segment(
    stub: store_pb2_grpc.SegmentStoreStub,
) -> None:
    payload = make_payload(4 * CHUNK_NBYTES)
    meta = make_meta([7, 8, 9], payload)
    first_chunk_sent = threading.Event()

    def stalled() -> Iterator[pb.PutSegmentRequest]:
        messages = put_requests(meta, payload, CHUNK_NBYTES)
        yield next(messages)
        yield next(messages)
        first_chunk_sent.set()
        time.sleep(5)  # never finishes: the call is cancelled first

    future = stub.PutSegment.future(stalled(), timeout=10)
    assert first_chunk_sent.wait(5)
    time.sleep(0.1)
    future.cancel()
    assert status_of(lambda: get(stub, meta)) == grpc.StatusCode.NOT_FOUND
    lookup = pb.LookupPrefixRequest(
        namespace=NAMESPACE, model_fingerprint=FINGERPRINT, token_ids=[7, 8, 9]
    )
    assert stub.LookupPrefix(lookup, timeout=5).num_matched_tokens == 0
    assert_still_serving(stub)


def test_segments_and_indexes_survive_a_restart(tmp_path: Path) -> None:
    socket = f"unix:{tmp_path}/store.sock"
    chain = make_chain([[1, 2, 3], [4, 5]], nbytes=2000)
    first = start_store(tmp_path / "lmdb", listen_address=socket)
    with grpc.insecure_channel(socket) as channel:
        for meta, payload in chain:
            put(store_pb2_grpc.SegmentStoreStub(channel), meta, payload)
    first.stop()
    second = start_store(tmp_path / "lmdb", listen_address=socket)
    try:
        with grpc.insecure_channel(socket) as channel:
            stub = store_pb2_grpc.SegmentStoreStub(channel)
            lookup = pb.LookupPrefixRequest(
                namespace=NAMESPACE, model_fingerprint=FINGERPRINT, token_ids=[1, 2, 3, 4, 5, 6]
            )
            assert stub.LookupPrefix(lookup, timeout=5).num_matched_tokens == 5
            for meta, payload in chain:
                assert get(stub, meta) == payload
    finally:
        second.stop()


def test_shutdown_turns_health_not_serving_and_drains_an_in_flight_put(tmp_path: Path) -> None:
    embedded = start_store(tmp_path / "lmdb", grace_period_s=5.0)
    payload = make_payload(3 * CHUNK_NBYTES)
    meta = make_meta([11, 12], payload)
    release = threading.Event()

    def slow() -> Iterator[pb.PutSegmentRequest]:
        messages = list(put_requests(meta, payload, CHUNK_NBYTES))
        yield messages[0]
        release.wait(5)
        yield from messages[1:]

    with grpc.insecure_channel(embedded.target) as channel:
        future = store_pb2_grpc.SegmentStoreStub(channel).PutSegment.future(slow(), timeout=10)
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        stopper = threading.Thread(target=embedded.stop)
        stopper.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()  # an open Watch would hold the drain for the whole grace period
        release.set()
        future.result(timeout=10)  # acknowledged during the drain ...
        stopper.join(10)
    reopened = start_store(tmp_path / "lmdb")
    try:
        with grpc.insecure_channel(reopened.target) as channel:
            assert get(store_pb2_grpc.SegmentStoreStub(channel), meta) == payload  # ... so not lost
    finally:
        reopened.stop()


def test_expired_segments_are_swept_without_being_read(tmp_path: Path) -> None:
    embedded = start_store(tmp_path / "lmdb", sweep_interval_s=0.05)
    try:
        with grpc.insecure_channel(embedded.target) as channel:
            stub = store_pb2_grpc.SegmentStoreStub(channel)
            payload = make_payload(100)
            put(stub, make_meta([1, 2], payload, ttl_s=0.1), payload)
            stats = pb.StatsRequest(namespace=NAMESPACE)
            assert stub.Stats(stats, timeout=5).num_segments == 1
            deadline = time.monotonic() + 5
            while stub.Stats(stats, timeout=5).num_segments and time.monotonic() < deadline:
                time.sleep(0.05)
            assert stub.Stats(stats, timeout=5).num_segments == 0
    finally:
        embedded.stop()
