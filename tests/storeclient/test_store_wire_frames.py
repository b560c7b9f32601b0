"""Client-side chunk frames: `put_frames` are `put_requests` serialized, and a GetSegment
reply reassembles to the same verified bytes whether chunks come as frames or messages."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers.store import make_meta, make_payload

from kvsplice.common.errors import CorruptPayload
from kvsplice.common.segment import SegmentMeta
from kvsplice.proto import store_pb2 as pb
from kvsplice.storeclient.wire import (
    SegmentAssembler,
    meta_to_header,
    parse_get_response,
    put_frames,
    put_requests,
)


def make_reply(meta: SegmentMeta, payload: bytes, chunk_nbytes: int) -> list[bytes]:
    """A GetSegment reply stream as the server serializes it."""
    messages = [pb.GetSegmentResponse(header=meta_to_header(meta))]
    messages += [
        pb.GetSegmentResponse(chunk=payload[i : i + chunk_nbytes])
        for i in range(0, len(payload), chunk_nbytes)
    ]
    return [m.SerializeToString() for m in messages]


def assemble(wire: list[bytes], parse: object) -> tuple[SegmentMeta, bytes]:
    assembler = SegmentAssembler()
    for message in wire:
        assembler.feed(parse(message))  # type: ignore[operator]
    return assembler.finish()


@pytest.mark.parametrize("nbytes", [0, 1, 999, 1000, 3001])
def test_put_frames_are_the_serialized_put_requests(nbytes: int) -> None:
    payload = make_payload(nbytes)
    meta = make_meta([1, 2], payload)
    expected = [m.SerializeToString() for m in put_requests(meta, payload, 1000)]
    assert list(put_frames(meta, payload, 1000)) == expected


def test_frames_and_messages_reassemble_to_the_same_bytes() -> None:
    payload = make_payload(3001)
    meta = make_meta([1, 2], payload)
    wire = make_reply(meta, payload, 1000)
    via_frames = assemble(wire, parse_get_response)
    via_messages = assemble(wire, pb.GetSegmentResponse.FromString)
    assert via_frames == via_messages == (meta, payload)
    assert isinstance(via_frames[1], memoryview) and not via_frames[1].readonly


def test_a_large_payload_lands_in_one_populated_buffer() -> None:
    payload = make_payload(3 << 20)
    meta = make_meta([1, 2], payload)
    meta_back, received = assemble(make_reply(meta, payload, 1 << 20), parse_get_response)
    assert meta_back == meta and received == payload and len(received) == len(payload)


def test_frames_are_verified_like_messages() -> None:
    payload = make_payload(2000)
    meta = make_meta([1, 2], payload)
    too_long = make_reply(meta, payload + b"x", 1000)
    with pytest.raises(CorruptPayload, match="more than 2000"):
        assemble(too_long, parse_get_response)
    tampered = make_reply(replace(meta, checksum=meta.checksum ^ 1), payload, 1000)
    with pytest.raises(CorruptPayload, match="checksum"):
        assemble(tampered, parse_get_response)
    with pytest.raises(CorruptPayload, match="before the segment header"):
        assemble(make_reply(meta, payload, 1000)[1:], parse_get_response)
