"""Hand-written chunk frames are protobuf's own bytes: encoding is byte-identical to
`SerializeToString`, decoding agrees with `FromString` or declines (never misreads)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.proto import store_pb2 as pb
from kvsplice.proto.segment_stream import chunk_view, encode_chunk

CHUNK_MESSAGES = (pb.PutSegmentRequest, pb.GetSegmentResponse)
# Lengths around every varint width change (1, 2, 3 and 4 length bytes).
BOUNDARY_NBYTES = (0, 1, 127, 128, 16_383, 16_384, 2_097_151, 2_097_152)


def make_chunk(nbytes: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def make_header() -> pb.SegmentHeader:
    return pb.SegmentHeader(namespace="tenant-a", payload_nbytes=3, token_ids=[1, 2, 3])


@pytest.mark.parametrize("message_type", CHUNK_MESSAGES)
@pytest.mark.parametrize("nbytes", BOUNDARY_NBYTES)
def test_encoding_is_protobufs_serialization(message_type: type, nbytes: int) -> None:
    chunk = make_chunk(nbytes)
    assert encode_chunk(memoryview(chunk)) == message_type(chunk=chunk).SerializeToString()


@given(st.binary(max_size=40_000))
def test_decoding_returns_what_protobuf_parses(chunk: bytes) -> None:
    for message_type in CHUNK_MESSAGES:
        wire = message_type(chunk=chunk).SerializeToString()
        view = chunk_view(wire)
        assert view is not None
        assert bytes(view) == message_type.FromString(wire).chunk == chunk


def test_decoding_copies_nothing() -> None:
    wire = encode_chunk(make_chunk(1000))
    view = chunk_view(wire)
    assert view is not None and view.obj is wire and view.readonly


@pytest.mark.parametrize(
    ("name", "wire"),
    [
        ("empty message", b""),
        ("header", pb.PutSegmentRequest(header=make_header()).SerializeToString()),
        ("cut short", encode_chunk(make_chunk(300))[:-1]),
        ("trailing field", encode_chunk(make_chunk(300)) + encode_chunk(b"x")),
        (
            "header after chunk",
            encode_chunk(b"ab") + pb.PutSegmentRequest(header=make_header()).SerializeToString(),
        ),
        ("unterminated varint", b"\x12\xff\xff"),
        ("varint past 10 bytes", b"\x12" + b"\x80" * 11 + b"\x00"),
    ],
)
def test_any_other_shape_is_left_to_protobuf(name: str, wire: bytes) -> None:
    assert chunk_view(wire) is None
