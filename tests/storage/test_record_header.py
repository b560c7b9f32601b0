"""A record header whose lengths cannot be real is corrupt, never an overflow."""

from __future__ import annotations

import struct

import pytest

from kvsplice.common.errors import CorruptPayload
from kvsplice.storage.record import open_record, read_header, seal

RAW_LEN_OFFSET = 16  # magic 4 | version 1 | flags 1 | reserved 2 | stored_len 8 | raw_len 8


def make_record_claiming(raw_nbytes: int) -> bytes:
    record = bytearray(seal(b"kv-bytes " * 200, compress=True))
    struct.pack_into("<Q", record, RAW_LEN_OFFSET, raw_nbytes)
    return bytes(record)


@pytest.mark.parametrize("raw_nbytes", [2**63, 2**64 - 1])
def test_a_body_longer_than_memory_can_hold_is_corrupt(raw_nbytes: int) -> None:
    record = make_record_claiming(raw_nbytes)
    with pytest.raises(CorruptPayload, match="claims a body"):
        read_header(record)
    with pytest.raises(CorruptPayload):
        open_record(record)
