"""The on-tier record envelope: header, optional zstd, xxh3-64 of the stored body.

Layout (little-endian, 32-byte header): magic "KVSR" | version u8 | flags u8 |
reserved u16 | stored_len u64 | raw_len u64 | xxh3_64(stored body) u64 | body.
A split record (flag 0x02, never compressed) covers its body in two parts, so that a
tail whose xxh3-64 arrived with it is never hashed again to seal it: the checksum field
covers body[head_len:], and the raw_len field holds head_len u32 | xxh3_64(head) low u32.
A split record may keep its tail outside (flag 0x04, with 0x02): the value is header,
head and a reference of the tier's own (the LMDB tier's payload files), not the tail.
Owns sealing and verification only; what the body means belongs to the caller.
"""

from __future__ import annotations

import struct
import sys
import threading
from dataclasses import dataclass

import xxhash
import zstandard

from kvsplice.common.errors import CorruptPayload
from kvsplice.common.payload_buffer import StagedFile

MAGIC = b"KVSR"
VERSION = 1
FLAG_ZSTD = 0x01
FLAG_SPLIT = 0x02
FLAG_TAIL_OUTSIDE = 0x04  # only with FLAG_SPLIT
_KNOWN_FLAGS = FLAG_ZSTD | FLAG_SPLIT | FLAG_TAIL_OUTSIDE
_FLAG_FORMS = (0, FLAG_ZSTD, FLAG_SPLIT, FLAG_SPLIT | FLAG_TAIL_OUTSIDE)
_FLAGS_AT = 5  # the flags byte's offset in the header
_HEAD_CHECKSUM_MASK = 0xFFFFFFFF
HEADER = struct.Struct("<4sBBHQQQ")
HEADER_NBYTES = HEADER.size
# Level 1: on int8 KV, levels 1-9 reach the same ratio (~1.02) and level 1 is ~2x faster.
ZSTD_LEVEL = 1
_PREFIX_CHUNK_NBYTES = 64 * 1024
_MAX_BODY_NBYTES = sys.maxsize  # a longer body cannot exist (and overflows C length arguments)

_local = threading.local()  # zstd contexts are not safe to share between threads


@dataclass(frozen=True)
class RecordHeader:
    flags: int
    stored_nbytes: int
    raw_nbytes: int
    checksum: int  # of the stored body; of its tail after `head_nbytes` in a split record
    head_nbytes: int = 0
    head_checksum: int = 0  # xxh3-64 of the head, low 32 bits (split records)

    @property
    def compressed(self) -> bool:
        return bool(self.flags & FLAG_ZSTD)

    @property
    def split(self) -> bool:
        return bool(self.flags & FLAG_SPLIT)

    @property
    def tail_outside(self) -> bool:
        return bool(self.flags & FLAG_TAIL_OUTSIDE)

    @property
    def record_nbytes(self) -> int:
        """The whole record's size (its tail's included where that lies outside the value)."""
        return HEADER_NBYTES + self.stored_nbytes


def _compressor() -> zstandard.ZstdCompressor:
    if not hasattr(_local, "compressor"):
        _local.compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return _local.compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def seal(body: bytes | memoryview, compress: bool = False) -> bytes:
    """Wrap `body` in a verified envelope, zstd-compressing it when `compress`."""
    raw_nbytes = len(body)
    stored = _compressor().compress(body) if compress else body
    flags = FLAG_ZSTD if compress else 0
    header = HEADER.pack(
        MAGIC, VERSION, flags, 0, len(stored), raw_nbytes, xxhash.xxh3_64_intdigest(stored)
    )
    return header + stored


@dataclass(frozen=True)
class SealedRecord:
    """A whole record (header, then body) that a tier stores as it is, sealed by
    `split_prefix`; `len()` is its body's size, as for a body handed to `seal`.
    `staged`: the file the record's tail lies in (a staged put), which a tier may adopt
    (`with_tail_outside`) instead of copying the tail out of `record`."""

    record: bytes | memoryview
    staged: StagedFile | None = None

    def __len__(self) -> int:
        return len(self.record) - HEADER_NBYTES


def split_prefix(head: bytes, tail_nbytes: int, tail_checksum: int) -> bytes:
    """Header and `head` of a split record whose body is `head` + a tail of `tail_nbytes`
    bytes with xxh3-64 `tail_checksum` (the caller vouches for it: the tail is not read)."""
    head_checksum = xxhash.xxh3_64_intdigest(head) & _HEAD_CHECKSUM_MASK
    header = HEADER.pack(
        MAGIC, VERSION, FLAG_SPLIT, 0, len(head) + tail_nbytes,
        (len(head) << 32) | head_checksum, tail_checksum,
    )  # fmt: skip
    return header + head


def with_tail_outside(record: bytes | memoryview, reference: bytes) -> bytes:
    """The value of split `record` with its tail kept outside: header (flagged), head and
    `reference` (where the tier keeps the tail) instead of the tail."""
    header = read_header(record)
    if not header.split or header.tail_outside:
        raise ValueError("only a split record with its tail inside can keep it outside")
    prefix = bytearray(record[: HEADER_NBYTES + header.head_nbytes])
    prefix[_FLAGS_AT] |= FLAG_TAIL_OUTSIDE
    return bytes(prefix) + reference


def tail_outside(raw: bytes | memoryview) -> bool:
    """Whether `raw` is a value whose tail lies outside it (False for a malformed header:
    `open_record` says why)."""
    try:
        return read_header(raw).tail_outside
    except CorruptPayload:
        return False


def outside_parts(raw: bytes | memoryview) -> tuple[RecordHeader, memoryview, memoryview]:
    """(header, verified head, reference) of a value whose tail lies outside; the tail's
    xxh3-64 is `header.checksum` (the caller checks it where it reads the tail)."""
    header = read_header(raw)
    if not header.tail_outside:
        raise CorruptPayload("record keeps its tail inside")
    stored = memoryview(raw)[HEADER_NBYTES:]
    head, reference = stored[: header.head_nbytes], stored[header.head_nbytes :]
    if xxhash.xxh3_64_intdigest(head) & _HEAD_CHECKSUM_MASK != header.head_checksum:
        raise CorruptPayload("record head checksum mismatch")
    return header, head, reference


def check_tail(tail: bytes | memoryview, header: RecordHeader) -> None:
    """`CorruptPayload` unless `tail` is the split record's tail (size and xxh3-64)."""
    if len(tail) != header.stored_nbytes - header.head_nbytes:
        raise CorruptPayload(
            f"record tail holds {len(tail)} bytes, header says "
            f"{header.stored_nbytes - header.head_nbytes}"
        )
    if xxhash.xxh3_64_intdigest(tail) != header.checksum:
        raise CorruptPayload("record checksum mismatch")


def as_record(value: bytes | memoryview | SealedRecord, compress: bool) -> bytes | memoryview:
    """The record a tier stores for `value`: a `SealedRecord` as it is (re-sealed only
    where the tier compresses), anything else sealed."""
    if not isinstance(value, SealedRecord):
        return seal(value, compress=compress)
    return seal(open_record(value.record), compress=True) if compress else value.record


def read_header(raw: bytes | memoryview) -> RecordHeader:
    """Parse and sanity-check the header at the start of `raw` (which may be a prefix)."""
    if len(raw) < HEADER_NBYTES:
        raise CorruptPayload(f"record of {len(raw)} bytes is shorter than its header")
    magic, version, flags, reserved, stored_nbytes, raw_nbytes, checksum = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptPayload(f"bad record magic {bytes(magic)!r}")
    if version != VERSION:
        raise CorruptPayload(f"unknown record version {version}")
    if flags not in _FLAG_FORMS or reserved:
        raise CorruptPayload(f"unknown record flags {flags:#x} / reserved bits {reserved:#x}")
    if flags & FLAG_SPLIT:
        head_nbytes, head_checksum = raw_nbytes >> 32, raw_nbytes & _HEAD_CHECKSUM_MASK
        if head_nbytes > stored_nbytes:
            raise CorruptPayload(f"split record's head of {head_nbytes} bytes > {stored_nbytes}")
        return RecordHeader(
            flags, stored_nbytes, stored_nbytes, checksum, head_nbytes, head_checksum
        )
    if not flags & FLAG_ZSTD and stored_nbytes != raw_nbytes:
        raise CorruptPayload(f"raw record stores {stored_nbytes} bytes but claims {raw_nbytes}")
    if raw_nbytes > _MAX_BODY_NBYTES:
        raise CorruptPayload(f"record claims a body of {raw_nbytes} bytes")
    return RecordHeader(flags, stored_nbytes, raw_nbytes, checksum)


def open_record(raw: bytes | memoryview) -> bytes | memoryview:
    """The verified body of a sealed record; raises `CorruptPayload` on any mismatch.

    A raw record's body is a zero-copy view into `raw` (valid as long as `raw` is).
    """
    header = read_header(raw)
    if header.tail_outside:
        raise CorruptPayload("record keeps its tail outside this value (not a tier's record)")
    if len(raw) != header.record_nbytes:
        raise CorruptPayload(f"record holds {len(raw)} bytes, header says {header.record_nbytes}")
    stored = memoryview(raw)[HEADER_NBYTES:]
    if header.split:
        _verify_split(stored, header)
        return stored
    if xxhash.xxh3_64_intdigest(stored) != header.checksum:
        raise CorruptPayload("record checksum mismatch")
    if not header.compressed:
        return stored
    try:
        body = _decompressor().decompress(stored, max_output_size=header.raw_nbytes)
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"zstd frame does not decode: {exc}") from exc
    if len(body) != header.raw_nbytes:
        raise CorruptPayload(f"body decodes to {len(body)} bytes, header says {header.raw_nbytes}")
    return body


def _verify_split(body: memoryview, header: RecordHeader) -> None:
    head, tail = body[: header.head_nbytes], body[header.head_nbytes :]
    if xxhash.xxh3_64_intdigest(head) & _HEAD_CHECKSUM_MASK != header.head_checksum:
        raise CorruptPayload("record head checksum mismatch")
    check_tail(tail, header)


def body_prefix(raw: bytes | memoryview, max_nbytes: int) -> bytes:
    """Up to `max_nbytes` of the body from the start of a record, header checked only.

    `raw` may itself be a prefix of the record; a compressed body is decoded only
    as far as needed. The bytes are not covered by the checksum: callers verify.
    """
    header = read_header(raw)
    if header.tail_outside:  # the head only: the tail is not in this value
        max_nbytes = min(max_nbytes, header.head_nbytes)
    stored = memoryview(raw)[HEADER_NBYTES : header.record_nbytes]
    if not header.compressed:
        return bytes(stored[:max_nbytes])
    decoder = zstandard.ZstdDecompressor().decompressobj()
    out = bytearray()
    try:
        for start in range(0, len(stored), _PREFIX_CHUNK_NBYTES):
            out += decoder.decompress(stored[start : start + _PREFIX_CHUNK_NBYTES])
            if len(out) >= max_nbytes:
                break
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"zstd frame does not decode: {exc}") from exc
    return bytes(out[:max_nbytes])
