"""Bodies of the records the store writes: a segment (meta + payload) or a blob.

Segment body: meta_len u32 | xxh3_64(meta) u64 | meta | payload, so ONE value
holds both and the meta can be read (and verified) without touching the payload.
Meta: version u8 | json_len u32 | JSON | n u32 | token_ids int32[n] | m u32 | left_tail int32[m];
the JSON holds every other `SegmentMeta` field under its own name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvsplice.common.errors import CorruptPayload, InvalidRequest
from kvsplice.common.payload_buffer import StagedFile
from kvsplice.common.segment import SegmentMeta
from kvsplice.storage.record import SealedRecord, split_prefix

# 2: kind and exact are fields (1 wrote them as labels; still read)
META_VERSION = 2
BLOB_VERSION = 1
_BODY_HEADER = struct.Struct("<IQ")
_META_HEADER = struct.Struct("<BI")
_COUNT = struct.Struct("<I")
_BLOB_HEADER = struct.Struct("<Bdd")
BODY_HEADER_NBYTES = _BODY_HEADER.size
_KEY_FIELDS = ("context_key", "parent_key", "content_key", "engine_parent_block_hash")
_HASH_LIST_FIELDS = ("engine_block_hashes",)  # bytes each, hex in the JSON
# Written only when set: a record without them is the size it was before they existed.
_OMITTED_WHEN_EMPTY = ("engine_block_hashes", "engine_parent_block_hash")
_PACKED_FIELDS = ("token_ids", "left_tail_ids")


def encode_meta(meta: SegmentMeta) -> bytes:
    """Every `SegmentMeta` field: the ids packed, the rest in JSON (keys as hex, tuples as lists)."""
    fields = {
        f.name: _jsonable(f.name, getattr(meta, f.name))
        for f in dataclasses.fields(SegmentMeta)
        if f.name not in _PACKED_FIELDS
        and not (f.name in _OMITTED_WHEN_EMPTY and not getattr(meta, f.name))
    }
    text = json.dumps(fields, separators=(",", ":")).encode()
    return b"".join(
        (
            _META_HEADER.pack(META_VERSION, len(text)),
            text,
            _pack_ids(meta.token_ids),
            _pack_ids(meta.left_tail_ids),
        )
    )


def decode_meta(raw: bytes | memoryview) -> SegmentMeta:
    """Inverse of `encode_meta`; raises `CorruptPayload` on anything malformed."""
    try:
        version, text_nbytes = _META_HEADER.unpack_from(raw)
        if version not in (1, META_VERSION):
            raise CorruptPayload(f"unknown segment meta version {version}")
        offset = _META_HEADER.size + text_nbytes
        fields = json.loads(bytes(raw[_META_HEADER.size : offset]))
        token_ids, offset = _unpack_ids(raw, offset)
        left_tail_ids, offset = _unpack_ids(raw, offset)
        if offset != len(raw):
            raise CorruptPayload(f"segment meta has {len(raw) - offset} trailing bytes")
        if version == 1:
            fields = _upgrade_v1(fields)
        return _meta_from_fields(fields, token_ids, left_tail_ids)
    except (ValueError, KeyError, TypeError, struct.error) as exc:  # json/struct/validation
        raise CorruptPayload(f"segment meta does not decode: {exc}") from exc


@dataclass(frozen=True)
class VerifiedPayload:
    """A payload its receiver vouches for, in `buffer[offset:]`: its xxh3-64 checked
    against `meta.checksum` (the one hash of a put), or, `staged` in a file of the client's
    on this host, hashed by the client alone (every load verifies it: `staged`).
    `buffer[:offset]` is writable scratch: a record's header written there joins the
    payload into one value without copying it."""

    buffer: memoryview  # flat bytes; writable where `offset` > 0
    offset: int = 0
    staged: StagedFile | None = None  # the file it lies in, which a tier may adopt

    @property
    def view(self) -> memoryview:
        return self.buffer[self.offset :]

    def __len__(self) -> int:
        return self.buffer.nbytes - self.offset


Payload = bytes | memoryview | VerifiedPayload


def payload_digest(payload: bytes | memoryview) -> int:
    """The checksum a segment's meta carries for its payload: xxh3-64 of its bytes."""
    return xxhash.xxh3_64_intdigest(payload)


def payload_view(meta: SegmentMeta, payload: Payload) -> memoryview:
    """`payload` as flat bytes; `InvalidRequest` unless its size and xxh3-64 match `meta`
    (a `VerifiedPayload` is not hashed again: its size is checked)."""
    if isinstance(payload, VerifiedPayload):
        if len(payload) != meta.payload_nbytes:
            raise InvalidRequest(
                f"payload holds {len(payload)} bytes, meta says {meta.payload_nbytes}"
            )
        return payload.view
    try:
        view = memoryview(payload)
    except TypeError as exc:
        raise InvalidRequest(f"payload of type {type(payload).__name__} is not bytes-like") from exc
    if not view.c_contiguous:
        raise InvalidRequest("payload is not a contiguous buffer")
    view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
    if view.nbytes != meta.payload_nbytes:
        raise InvalidRequest(f"payload holds {view.nbytes} bytes, meta says {meta.payload_nbytes}")
    if payload_digest(view) != meta.checksum:
        raise InvalidRequest("payload checksum does not match meta.checksum (xxh3-64)")
    return view


def encode_segment(meta: SegmentMeta, payload: bytes | memoryview) -> bytes:
    """The record body holding `meta` and `payload`."""
    return b"".join((segment_head(meta), payload))


def segment_head(meta: SegmentMeta) -> bytes:
    """The start of a segment's body: everything before its payload."""
    meta_raw = encode_meta(meta)
    return _BODY_HEADER.pack(len(meta_raw), xxhash.xxh3_64_intdigest(meta_raw)) + meta_raw


def sealed_segment(meta: SegmentMeta, payload: Payload) -> tuple[SealedRecord, bytes]:
    """The record of `meta` and its `payload` (checked by `payload_view`), and its head.

    Split (`record.split_prefix`): the payload's digest is `meta.checksum`, never hashed
    again. Built in place where `payload` has room before it, else copied once.
    """
    view = payload_view(meta, payload)
    head = segment_head(meta)
    prefix = split_prefix(head, len(view), meta.checksum)
    if isinstance(payload, VerifiedPayload) and payload.offset >= len(prefix):
        start = payload.offset - len(prefix)
        payload.buffer[start : payload.offset] = prefix
        return SealedRecord(payload.buffer[start:], payload.staged), head
    return SealedRecord(b"".join((prefix, view))), head


def meta_span(head: bytes | memoryview) -> int:
    """How many leading body bytes `read_meta` needs, from at least the body header."""
    if len(head) < BODY_HEADER_NBYTES:
        raise CorruptPayload(f"segment body of {len(head)} bytes is shorter than its header")
    meta_nbytes, _ = _BODY_HEADER.unpack_from(head)
    return int(BODY_HEADER_NBYTES + meta_nbytes)


def meta_digest(body: bytes | memoryview) -> int:
    """The checksum of the meta section: identifies the meta version a body carries."""
    meta_span(body)
    return int(_BODY_HEADER.unpack_from(body)[1])


def read_meta(head: bytes | memoryview) -> SegmentMeta:
    """The verified meta of a segment body, reading only its first `meta_span` bytes."""
    end = meta_span(head)
    if len(head) < end:
        raise CorruptPayload(f"segment body of {len(head)} bytes is shorter than its meta ({end})")
    meta_raw = memoryview(head)[BODY_HEADER_NBYTES:end]
    if xxhash.xxh3_64_intdigest(meta_raw) != meta_digest(head):
        raise CorruptPayload("segment meta checksum mismatch")
    return decode_meta(meta_raw)


def segment_payload(body: bytes | memoryview, meta: SegmentMeta) -> memoryview:
    """Zero-copy view of the payload in `body`; its size must match `meta`."""
    payload = memoryview(body)[meta_span(body) :]
    if len(payload) != meta.payload_nbytes:
        raise CorruptPayload(f"payload holds {len(payload)} bytes, meta says {meta.payload_nbytes}")
    return payload


@dataclass(frozen=True)
class BlobHeader:
    created_at_s: float
    ttl_s: float | None

    def expired(self, now_s: float) -> bool:
        return self.ttl_s is not None and self.created_at_s + self.ttl_s < now_s


def encode_blob(data: bytes | memoryview, created_at_s: float, ttl_s: float | None) -> bytes:
    ttl_field = math.nan if ttl_s is None else ttl_s
    return b"".join((_BLOB_HEADER.pack(BLOB_VERSION, created_at_s, ttl_field), data))


def decode_blob(body: bytes | memoryview) -> tuple[BlobHeader, memoryview]:
    if len(body) < _BLOB_HEADER.size:
        raise CorruptPayload(f"blob body of {len(body)} bytes is shorter than its header")
    version, created_at_s, ttl_field = _BLOB_HEADER.unpack_from(body)
    if version != BLOB_VERSION:
        raise CorruptPayload(f"unknown blob version {version}")
    ttl_s = None if math.isnan(ttl_field) else ttl_field
    return BlobHeader(created_at_s, ttl_s), memoryview(body)[_BLOB_HEADER.size :]


def _pack_ids(ids: tuple[int, ...]) -> bytes:
    return _COUNT.pack(len(ids)) + np.asarray(ids, dtype="<i4").tobytes()


def _unpack_ids(raw: bytes | memoryview, offset: int) -> tuple[tuple[int, ...], int]:
    (count,) = _COUNT.unpack_from(raw, offset)
    start = offset + _COUNT.size
    end = start + 4 * count
    if end > len(raw):
        raise CorruptPayload(f"segment meta truncated: {count} ids need {end} > {len(raw)} bytes")
    ids = np.frombuffer(raw, dtype="<i4", count=count, offset=start)
    return tuple(ids.tolist()), end


def _jsonable(name: str, value: object) -> object:
    if name in _KEY_FIELDS:
        return value.hex()  # type: ignore[attr-defined]
    if name in _HASH_LIST_FIELDS:
        return [h.hex() for h in value]  # type: ignore[attr-defined]
    if isinstance(value, tuple):
        return [list(v) if isinstance(v, tuple) else v for v in value]
    return value


def _upgrade_v1(fields: dict) -> dict:
    """Version 1 wrote a segment's kind and exactness as labels ("kind", "exact" "0"|"1")."""
    labels = [(str(k), str(v)) for k, v in fields.pop("labels")]
    typed = dict(labels)
    fields["kind"] = typed.get("kind", "prompt")
    fields["exact"] = typed.get("exact") == "1"
    fields["labels"] = [(k, v) for k, v in labels if k not in ("kind", "exact")]
    return fields


def _meta_from_fields(
    fields: dict[str, Any], token_ids: tuple[int, ...], left_tail_ids: tuple[int, ...]
) -> SegmentMeta:
    # NOTE: records written before a field existed lack it: the field's default applies.
    fields.update({name: bytes.fromhex(fields[name]) for name in _KEY_FIELDS if name in fields})
    fields.update(
        {name: tuple(bytes.fromhex(h) for h in fields[name]) for name in _HASH_LIST_FIELDS
         if name in fields}
    )  # fmt: skip
    boundary_layers = tuple(fields.pop("boundary_layers"))
    labels = tuple((str(k), str(v)) for k, v in fields.pop("labels"))
    return SegmentMeta(
        **fields,
        token_ids=token_ids,
        left_tail_ids=left_tail_ids,
        boundary_layers=boundary_layers,
        labels=labels,
    )
