"""Server-side conversion: header ⇄ meta is the identity; the put stream protocol is enforced."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

import pytest
from helpers.store import make_meta, make_payload

from kvsplice.common.errors import CorruptPayload, InvalidRequest
from kvsplice.common.segment import SegmentMeta
from kvsplice.proto import store_pb2 as pb
from kvsplice.server.convert import (
    header_to_meta,
    meta_to_header,
    receive_segment,
    segment_frames,
)
from kvsplice.storage.tiered_store import StoredSegment


def make_rich_meta() -> SegmentMeta:
    payload = make_payload(10)
    return make_meta(
        range(5, 25),
        payload,
        boundary_layers=(4, 8),
        ttl_s=30.0,
        left_tail_ids=(1, 2, 3),
        index_text="the question",
        labels=(("agent", "critic"), ("round", "2")),
        kind="response",
        exact=True,
    )


def test_header_round_trip_is_the_identity_except_created_at() -> None:
    meta = replace(make_rich_meta(), created_at_s=123.5)
    back = header_to_meta(meta_to_header(meta))
    assert back == replace(meta, created_at_s=0.0)  # the server, not the caller, stamps it


def test_a_header_without_a_kind_reads_as_a_prompt_and_a_bad_kind_is_refused() -> None:
    header = meta_to_header(make_rich_meta())
    header.kind = ""  # a writer older than the field
    assert header_to_meta(header).kind == "prompt"
    header.kind = "anchor"
    with pytest.raises(InvalidRequest, match="kind"):
        header_to_meta(header)


def test_malformed_header_is_an_invalid_request() -> None:
    header = meta_to_header(make_rich_meta())
    header.context_key = b"short"
    with pytest.raises(InvalidRequest, match="context_key"):
        header_to_meta(header)


async def _stream(messages: Sequence[pb.PutSegmentRequest]) -> AsyncIterator[pb.PutSegmentRequest]:
    for message in messages:
        yield message


def _header(meta: SegmentMeta) -> pb.PutSegmentRequest:
    return pb.PutSegmentRequest(header=meta_to_header(meta))


def _chunk(data: bytes) -> pb.PutSegmentRequest:
    return pb.PutSegmentRequest(chunk=data)


async def test_chunks_reassemble_into_the_payload() -> None:
    payload = make_payload(1000)
    meta = make_meta([1, 2], payload)
    messages = [
        _header(meta),
        _chunk(payload[:300]),
        _chunk(payload[300:999]),
        _chunk(payload[999:]),
    ]
    received_meta, received = await receive_segment(_stream(messages), lambda m: m)
    assert bytes(received) == payload
    assert received_meta.context_key == meta.context_key


def _bad_streams() -> list[tuple[str, list[pb.PutSegmentRequest], type[Exception], str]]:
    payload = make_payload(100)
    meta = make_meta([1, 2], payload)
    return [
        ("empty stream", [], InvalidRequest, "without a header"),
        ("chunk first", [_chunk(payload), _header(meta)], InvalidRequest, "before its header"),
        ("two headers", [_header(meta), _header(meta)], InvalidRequest, "second header"),
        ("empty message", [_header(meta), pb.PutSegmentRequest()], InvalidRequest, "neither"),
        ("too many bytes", [_header(meta), _chunk(payload + b"x")], CorruptPayload, "exceeds"),
        ("ends early", [_header(meta), _chunk(payload[:60])], CorruptPayload, "60 of 100"),
        ("header only", [_header(meta)], CorruptPayload, "0 of 100"),
    ]


@pytest.mark.parametrize(("name", "messages", "error", "message"), _bad_streams())
async def test_malformed_put_streams_are_refused(
    name: str, messages: list[pb.PutSegmentRequest], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        await receive_segment(_stream(messages), lambda m: m)


async def test_header_is_checked_before_any_payload_is_buffered() -> None:
    payload = make_payload(100)
    meta = make_meta([1, 2], payload)
    seen: list[str] = []

    def refuse(checked: SegmentMeta) -> SegmentMeta:
        raise InvalidRequest("refused")

    async def messages() -> AsyncIterator[pb.PutSegmentRequest]:
        yield _header(meta)
        seen.append("payload requested")
        yield _chunk(payload)

    with pytest.raises(InvalidRequest, match="refused"):
        await receive_segment(messages(), refuse)
    assert seen == []


def test_segment_frames_send_the_header_then_bounded_chunks() -> None:
    payload = make_payload(2500)
    meta = make_meta([1], payload)
    frames = segment_frames(StoredSegment(meta, memoryview(payload)), chunk_nbytes=1000)
    responses = [pb.GetSegmentResponse.FromString(frame) for frame in frames]
    assert responses[0].WhichOneof("part") == "header"
    chunks = [r.chunk for r in responses[1:]]
    assert [len(c) for c in chunks] == [1000, 1000, 500]
    assert b"".join(chunks) == payload
