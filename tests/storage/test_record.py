"""Record envelope: round trips, and every single-byte corruption is caught."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.common.errors import CorruptPayload
from kvsplice.storage.record import (
    HEADER_NBYTES,
    body_prefix,
    open_record,
    read_header,
    seal,
    split_prefix,
)


@settings(max_examples=50, deadline=None)
@given(body=st.binary(max_size=5000), compress=st.booleans())
def test_seal_then_open_is_the_identity(body: bytes, compress: bool) -> None:
    assert bytes(open_record(seal(body, compress=compress))) == body


@settings(max_examples=100, deadline=None)
@given(data=st.data(), compress=st.booleans())
def test_any_flipped_byte_is_caught(data: st.DataObject, compress: bool) -> None:
    record = bytearray(seal(b"kv-bytes " * 200, compress=compress))
    position = data.draw(st.integers(0, len(record) - 1))
    record[position] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptPayload):
        open_record(bytes(record))


@pytest.mark.parametrize("compress", [False, True])
def test_truncated_and_extended_records_are_corrupt(compress: bool) -> None:
    record = seal(b"x" * 1000, compress=compress)
    for bad in (record[:-1], record + b"\x00", record[: HEADER_NBYTES - 1], b""):
        with pytest.raises(CorruptPayload):
            open_record(bad)


def test_compression_is_flagged_and_shrinks_redundant_bodies() -> None:
    body = bytes(100_000)
    assert read_header(seal(body, compress=True)).compressed
    assert not read_header(seal(body)).compressed
    assert len(seal(body, compress=True)) < len(body) // 100


@pytest.mark.parametrize("compress", [False, True])
def test_body_prefix_reads_only_the_start(compress: bool) -> None:
    body = bytes(range(256)) * 4000
    record = seal(body, compress=compress)
    assert body_prefix(record, 300) == body[:300]
    assert body_prefix(record, 10**7) == body
    if not compress:  # a raw record's prefix can be read from a prefix of the record
        assert body_prefix(record[: HEADER_NBYTES + 300], 300) == body[:300]


def test_bad_magic_is_corrupt() -> None:
    record = b"XXXX" + seal(b"abc")[4:]
    with pytest.raises(CorruptPayload, match="magic"):
        open_record(record)


def test_a_split_record_verifies_head_and_tail_and_refuses_any_flipped_byte() -> None:
    head, tail = b"meta" * 50, bytes(range(256)) * 40
    record = split_prefix(head, len(tail), xxhash.xxh3_64_intdigest(tail)) + tail
    header = read_header(record)
    assert header.split and not header.compressed and header.head_nbytes == len(head)
    assert bytes(open_record(record)) == head + tail
    assert body_prefix(record, len(head)) == head
    for offset in (0, HEADER_NBYTES + 3, HEADER_NBYTES + len(head) + 5, len(record) - 1):
        flipped = bytearray(record)
        flipped[offset] ^= 0x01
        with pytest.raises(CorruptPayload):
            open_record(bytes(flipped))
