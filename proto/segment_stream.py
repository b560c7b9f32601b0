"""The PutSegment/GetSegment stream's messages: its header frame and its payload chunk frames.

Owns the one `SegmentMeta` ⇄ protobuf `SegmentHeader` mapping both client and server use
(field mapping only: each side decides which of our errors a malformed header is, the
server the caller's `InvalidRequest`, the client a corrupt reply, by catching the
`ValueError` raised here), and the payload chunks written and read without protobuf
objects: a `PutSegmentRequest`/`GetSegmentResponse` holding only its `bytes chunk` is
exactly the field's tag, a varint length, the bytes. Hand-written (not generated): headers
and every other message stay protobuf's; `tests/proto/test_chunk_frames.py` checks both agree.
"""

from __future__ import annotations

from typing import cast

from kvsplice.common.segment import SegmentKind, SegmentMeta
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


def meta_to_header(meta: SegmentMeta) -> pb.SegmentHeader:
    return pb.SegmentHeader(
        namespace=meta.namespace,
        model_fingerprint=meta.model_fingerprint,
        context_key=meta.context_key,
        parent_key=meta.parent_key,
        content_key=meta.content_key,
        token_ids=meta.token_ids,
        start_position=meta.start_position,
        layer_start=meta.layer_start,
        layer_end=meta.layer_end,
        boundary_layers=meta.boundary_layers,
        payload_nbytes=meta.payload_nbytes,
        checksum=meta.checksum,
        ttl_s=meta.ttl_s or 0.0,
        left_tail_ids=meta.left_tail_ids,
        index_text=meta.index_text,
        created_at_s=meta.created_at_s,
        labels=[pb.Label(key=k, value=v) for k, v in meta.labels],
        kind=meta.kind,
        exact=meta.exact,
        engine_block_hashes=meta.engine_block_hashes,
        engine_parent_block_hash=meta.engine_parent_block_hash,
    )


def header_to_meta(header: pb.SegmentHeader, *, keep_created_at: bool) -> SegmentMeta:
    """The header as `SegmentMeta`; raises `ValueError` naming the bad field.

    `keep_created_at=False` drops the sender's timestamp (the server stamps its own).
    """
    return SegmentMeta(
        namespace=header.namespace,
        model_fingerprint=header.model_fingerprint,
        context_key=header.context_key,
        parent_key=header.parent_key,
        content_key=header.content_key,
        token_ids=tuple(header.token_ids),
        start_position=header.start_position,
        layer_start=header.layer_start,
        layer_end=header.layer_end,
        boundary_layers=tuple(header.boundary_layers),
        payload_nbytes=header.payload_nbytes,
        checksum=header.checksum,
        ttl_s=header.ttl_s or None,
        created_at_s=header.created_at_s if keep_created_at else 0.0,
        left_tail_ids=tuple(header.left_tail_ids),
        index_text=header.index_text,
        labels=tuple((label.key, label.value) for label in header.labels),
        kind=cast(SegmentKind, header.kind or "prompt"),
        exact=header.exact,
        engine_block_hashes=tuple(header.engine_block_hashes),
        engine_parent_block_hash=header.engine_parent_block_hash,
    )
