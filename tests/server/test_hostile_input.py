"""Hostile input against a real store: any bytes or any field values on any RPC get a
deliberate status (never UNKNOWN or INTERNAL, never a traceback), the log stays bounded,
the data stays intact; header fields are validated by name; keys are immutable."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from helpers.store import FINGERPRINT, NAMESPACE, make_meta, make_payload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsplice.common.errors import AlreadyExists
from kvsplice.common.keys import KEY_NBYTES
from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.server.servicer import SERVICE_NAME
from kvsplice.storeclient.wire import meta_to_header, put_requests

SERVICE = pb.DESCRIPTOR.services_by_name["SegmentStore"]
BAD_CODES = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
INT_RANGES = {
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
}
FUZZ = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Values of one field, biased toward ones that pass the cheap checks (so that the
    fuzz reaches deep code) and toward edges (NaN, inf, out-of-range ids, odd strings)."""
    if field.name == "namespace":
        return st.one_of(st.just(NAMESPACE), st.sampled_from(["ns\n", "", "a" * 200]), st.text())
    if field.name == "model_fingerprint":
        return st.one_of(st.just(FINGERPRINT), st.text(max_size=40))
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.binary(min_size=KEY_NBYTES, max_size=KEY_NBYTES), st.binary())
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.from_regex(r"[a-z][a-z0-9]{0,8}", fullmatch=True), st.text())
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.floats(), st.sampled_from([math.nan, math.inf, -math.inf, -1.0]))
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    low, high = INT_RANGES[field.type]
    return st.one_of(st.integers(0, 1000), st.integers(low, high))


def message(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """Keyword arguments of a message of `descriptor` with every field drawn."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key, value = field.message_type.fields
            fields[field.name] = st.dictionaries(scalar(key), scalar(value), max_size=3)
        elif field.message_type is not None:
            inner = message(field.message_type, depth + 1) if depth < 2 else st.just({})
            one = inner.map(lambda kw, t=field.message_type: _build(t, kw))
            repeated = field.is_repeated
            fields[field.name] = st.lists(one, max_size=3) if repeated else one
        elif field.is_repeated:
            fields[field.name] = st.lists(scalar(field), max_size=20)
        else:
            fields[field.name] = scalar(field)
    return st.fixed_dictionaries({}, optional=fields)


def _build(descriptor: Descriptor, kwargs: dict[str, Any]) -> Any:
    cls = getattr(pb, descriptor.name)
    if descriptor.name in ("PutSegmentRequest", "GetSegmentResponse"):
        kwargs = dict(list(kwargs.items())[:1])  # a oneof holds one part
    return cls(**kwargs)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedStore]:
    config = loopback_config(str(tmp_path_factory.mktemp("fuzz") / "lmdb"))
    with EmbeddedStore(config) as embedded:
        yield embedded


@pytest.fixture(scope="module")
def channel(store: EmbeddedStore) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(store.target) as opened:
        yield opened


@pytest.fixture(scope="module")
def kept(channel: grpc.Channel) -> tuple[Any, bytes]:
    """A segment stored before the fuzzing starts; it must come back unchanged."""
    payload = make_payload(30_000, seed=3)
    meta = make_meta([4, 4, 4, 4], payload)
    store_pb2_grpc.SegmentStoreStub(channel).PutSegment(put_requests(meta, payload, 8192))
    return meta, payload


def send_raw(channel: grpc.Channel, method: str, frames: list[bytes]) -> grpc.StatusCode:
    """Send already-serialized messages to `method`; the status it ends with."""
    path = f"/{SERVICE_NAME}/{method}"
    rpc = pb.DESCRIPTOR.services_by_name["SegmentStore"].methods_by_name[method]
    try:
        if rpc.client_streaming:
            channel.stream_unary(path)(iter(frames), timeout=10)
        elif rpc.server_streaming:
            list(channel.unary_stream(path)(frames[0], timeout=10))
        else:
            channel.unary_unary(path)(frames[0], timeout=10)
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def assert_intact(channel: grpc.Channel, kept: tuple[Any, bytes]) -> None:
    meta, payload = kept
    request = pb.GetSegmentRequest(namespace=meta.namespace, context_key=meta.context_key)
    replies = list(store_pb2_grpc.SegmentStoreStub(channel).GetSegment(request, timeout=10))
    assert b"".join(r.chunk for r in replies[1:]) == payload


def no_tracebacks(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]


@pytest.mark.parametrize("method", [m.name for m in SERVICE.methods])
def test_fuzzed_messages_get_deliberate_statuses(
    method: str, channel: grpc.Channel, kept: tuple[Any, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    descriptor = SERVICE.methods_by_name[method].input_type
    if method == "PutSegment":
        frames = st.tuples(
            message(pb.SegmentHeader.DESCRIPTOR), st.lists(st.binary(max_size=64), max_size=3)
        ).map(
            lambda hc: [
                pb.PutSegmentRequest(header=pb.SegmentHeader(**hc[0])).SerializeToString(),
                *(pb.PutSegmentRequest(chunk=c).SerializeToString() for c in hc[1]),
            ]
        )
    else:
        frames = message(descriptor).map(lambda kw: [_build(descriptor, kw).SerializeToString()])

    @FUZZ
    @given(frames=frames)
    def fuzz(frames: list[bytes]) -> None:
        assert send_raw(channel, method, frames) not in BAD_CODES

    fuzz()
    assert_intact(channel, kept)
    assert no_tracebacks(caplog) == []


def test_raw_garbage_on_every_rpc_is_invalid_argument_with_a_bounded_log(
    channel: grpc.Channel, kept: tuple[Any, bytes], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    rng = random.Random(16)
    codes = set()
    for _ in range(20):
        for method in SERVICE.methods:
            garbage = rng.randbytes(rng.randint(1, 64))
            codes.add(send_raw(channel, method.name, [b"\x0a\x02\xff\xff" + garbage]))
    assert codes <= {grpc.StatusCode.INVALID_ARGUMENT}, codes
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) <= 1 and no_tracebacks(caplog) == []
    assert_intact(channel, kept)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"ttl_s": math.nan}, "ttl_s"),
        ({"ttl_s": math.inf}, "ttl_s"),
        ({"ttl_s": -1.0}, "ttl_s"),
        ({"left_tail_ids": [2**40]}, "left_tail_ids"),
        ({"left_tail_ids": [-1]}, "left_tail_ids"),
        ({"namespace": "ns\n"}, "namespace"),
        ({"start_position": 2**40}, "start_position"),
        ({"layer_start": -1}, "layer"),
        ({"labels": [pb.Label(key="", value="v")]}, "labels"),
    ],
)
def test_bad_header_fields_are_invalid_argument_naming_the_field(
    channel: grpc.Channel, change: dict[str, Any], field: str
) -> None:
    payload = make_payload(100)
    header = meta_to_header(make_meta([9], payload))
    for name, value in change.items():
        if isinstance(value, list):
            del getattr(header, name)[:]
            getattr(header, name).extend(value)
        else:
            setattr(header, name, value)
    frames = [pb.PutSegmentRequest(header=header), pb.PutSegmentRequest(chunk=payload)]
    with pytest.raises(grpc.RpcError) as caught:
        store_pb2_grpc.SegmentStoreStub(channel).PutSegment(iter(frames), timeout=10)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details()


def test_keys_are_immutable_and_an_identical_put_is_idempotent(channel: grpc.Channel) -> None:
    stub = store_pb2_grpc.SegmentStoreStub(channel)
    payload = make_payload(5000, seed=11)
    meta = make_meta([5, 6, 7, 8], payload)
    for _ in range(2):
        stub.PutSegment(put_requests(meta, payload, 4096), timeout=10)
    other = make_payload(5000, seed=12)
    forged = replace(meta, checksum=make_meta([5, 6, 7, 8], other).checksum)
    for attempt in (put_requests(forged, other, 4096),):
        with pytest.raises(grpc.RpcError) as caught:
            stub.PutSegment(attempt, timeout=10)
        assert caught.value.code() is grpc.StatusCode.ALREADY_EXISTS
    assert_intact(channel, (meta, payload))
    assert AlreadyExists.status_name == "ALREADY_EXISTS"


def test_nan_ttl_is_refused_and_expiry_goes_on(tmp_path: Path) -> None:
    config = loopback_config(str(tmp_path / "lmdb"), sweep_interval_s=0.2)
    with EmbeddedStore(config) as store, grpc.insecure_channel(store.target) as channel:
        stub = store_pb2_grpc.SegmentStoreStub(channel)
        payload = make_payload(100)
        nan = meta_to_header(make_meta([1], payload))
        nan.ttl_s = math.nan
        with pytest.raises(grpc.RpcError):
            stub.PutSegment(iter([pb.PutSegmentRequest(header=nan)]), timeout=10)
        short = replace(make_meta([2], payload), ttl_s=0.3)
        stub.PutSegment(put_requests(short, payload, 4096), timeout=10)
        assert store._server is not None
        deadline = time.monotonic() + 10
        while store._server.store.stats().num_segments and time.monotonic() < deadline:
            time.sleep(0.1)
        assert store._server.store.stats().num_segments == 0


def test_garbage_to_the_health_service_is_invalid_argument(
    channel: grpc.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    check = channel.unary_unary("/grpc.health.v1.Health/Check")
    with pytest.raises(grpc.RpcError) as caught:
        check(b"\x0a\xff\xff\xff\xff\x0f garbage", timeout=10)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert no_tracebacks(caplog) == []
