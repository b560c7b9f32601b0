"""Payload chunks of PutSegment/GetSegment on the wire, written and read without protobuf objects.

A `PutSegmentRequest`/`GetSegmentResponse` holding only its `bytes chunk` is exactly: the
field's tag, a varint length, the bytes. Hand-written (not generated): headers and every
other message stay protobuf's; `tests/server/test_chunk_frames.py` checks both agree.
"""

from __future__ import annotations

from kvsplice.proto import store_pb2 as pb

_LENGTH_DELIMITED = 2  # protobuf wire type of `bytes`
_MAX_VARINT_NBYTES = 10


def _chunk_tag() -> int:
    numbers = {
        message.DESCRIPTOR.fields_by_name["chunk"].number
        for message in (pb.PutSegmentRequest, pb.GetSegmentResponse)
    }
    (number,) = numbers  # both messages must number their chunk alike
    return number << 3 | _LENGTH_DELIMITED


CHUNK_TAG = _chunk_tag()
_TAG_BYTES = bytes([CHUNK_TAG])  # one byte while the field number is below 16


def encode_chunk(chunk: bytes | memoryview) -> bytes:
    """The message holding only `chunk`, serialized as protobuf would (one copy of `chunk`).

    NOTE: protobuf's own path copies a multi-MiB chunk three times (bytes object,
    message arena, serialized string), each into fresh pages: ~20 ms per 8 MiB here.
    """
    return b"".join((_TAG_BYTES, _varint(len(chunk)), chunk))


def chunk_view(message: bytes) -> memoryview | None:
    """Zero-copy view of the chunk of a serialized message holding only a chunk, else None.

    None means "not that shape" (a header, an empty or unusual message): parse it with
    protobuf, which then decides what it is.
    """
    if not message or message[0] != CHUNK_TAG:
        return None
    nbytes, start = _read_varint(message, 1)
    if nbytes is None or start + nbytes != len(message):
        return None
    return memoryview(message)[start:]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, start: int) -> tuple[int | None, int]:
    """The varint at `start` and the offset after it; None if it is cut short or too long."""
    value = 0
    for offset in range(start, min(start + _MAX_VARINT_NBYTES, len(data))):
        byte = data[offset]
        value |= (byte & 0x7F) << (7 * (offset - start))
        if byte < 0x80:
            return value, offset + 1
    return None, start
