"""The `StorageTier` contract, one suite run over every tier (raw and zstd records)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import xxhash

from kvsplice.common.errors import CorruptPayload, StoreUnavailable
from kvsplice.storage.config import LMDBTierConfig, MemoryTierConfig, RedisTierConfig
from kvsplice.storage.lmdb_tier import LMDBTier
from kvsplice.storage.memory_tier import MemoryTier
from kvsplice.storage.record import SealedRecord, split_prefix
from kvsplice.storage.redis_tier import RedisTier
from kvsplice.storage.tier import StorageTier, TierStats

MIB = 1 << 20
BINARY_KEYS = (b"\x00", b"\xff\x00*?[]\\", b"k" * 200, b"s\x00tenant\x00" + bytes(range(16)))


@dataclass
class TierUnderTest:
    tier: StorageTier
    corrupt: Callable[[bytes], None]  # flips the last stored byte of a key's record


def _flipped_last(raw: bytes) -> bytes:
    return raw[:-1] + bytes([raw[-1] ^ 0xFF])


def _memory(compress: bool) -> TierUnderTest:
    tier = MemoryTier(MemoryTierConfig(max_bytes=32 * MIB, compress=compress))

    def corrupt(key: bytes) -> None:
        tier._records[key] = _flipped_last(tier._records[key])

    return TierUnderTest(tier, corrupt)


def _lmdb(compress: bool, path: Path) -> TierUnderTest:
    tier = LMDBTier(
        LMDBTierConfig(str(path), map_size_bytes=64 * MIB, compress=compress, sync=False)
    )

    def corrupt(key: bytes) -> None:
        with tier._env.begin(write=True, db=tier._db) as txn:
            txn.put(key, _flipped_last(txn.get(key)))

    return TierUnderTest(tier, corrupt)


def _redis(compress: bool, client: redis.Redis, prefix: str) -> TierUnderTest:
    tier = RedisTier(RedisTierConfig(key_prefix=prefix, compress=compress))

    def corrupt(key: bytes) -> None:
        full = tier._full(key)
        client.set(full, _flipped_last(client.get(full)))

    return TierUnderTest(tier, corrupt)


@pytest.fixture(params=[False, True], ids=["raw", "zstd"])
def compress(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.fixture(params=["memory", "lmdb", pytest.param("redis", marks=pytest.mark.redis)])
def subject(
    request: pytest.FixtureRequest, compress: bool, tmp_path: Path
) -> Iterator[TierUnderTest]:
    if request.param == "memory":
        made = _memory(compress)
    elif request.param == "lmdb":
        made = _lmdb(compress, tmp_path / "lmdb")
    else:
        client = request.getfixturevalue("redis_client")
        made = _redis(compress, client, request.getfixturevalue("redis_prefix"))
    yield made
    made.tier.close()


@pytest.fixture
def tier(subject: TierUnderTest) -> StorageTier:
    return subject.tier


def test_binary_keys_and_values_round_trip(tier: StorageTier, make_payload) -> None:
    values = {key: make_payload(4096, seed=i) + b"\x00\xff" for i, key in enumerate(BINARY_KEYS)}
    for key, value in values.items():
        tier.put(key, value)
    for key, value in values.items():
        assert bytes(tier.get(key)) == value
    assert set(tier.keys()) == set(values)


def test_a_miss_is_none(tier: StorageTier) -> None:
    assert tier.get(b"absent") is None
    assert tier.get_prefix(b"absent", 16) is None
    assert not tier.contains(b"absent")
    assert tier.delete(b"absent") is False


def test_overwrite_replaces_the_value(tier: StorageTier, make_payload) -> None:
    first, second = make_payload(50_000, seed=1), make_payload(50_000, seed=2)
    tier.put(b"k", first)
    used_once = tier.used_bytes()
    tier.put(b"k", second)
    assert bytes(tier.get(b"k")) == second
    assert list(tier.keys()) == [b"k"]
    assert tier.used_bytes() == used_once


def test_empty_value(tier: StorageTier) -> None:
    tier.put(b"empty", b"")
    assert tier.contains(b"empty")
    assert bytes(tier.get(b"empty")) == b""


def test_8_mib_value(tier: StorageTier, make_payload) -> None:
    value = make_payload(8 * MIB, seed=3)
    tier.put(b"big", memoryview(value))
    assert bytes(tier.get(b"big")) == value


def test_delete_and_contains(tier: StorageTier) -> None:
    tier.put(b"a", b"1")
    tier.put(b"b", b"2")
    assert tier.delete(b"a") is True
    assert not tier.contains(b"a") and tier.get(b"a") is None
    assert tier.contains(b"b")
    assert tier.delete(b"a") is False


def test_keys_filters_by_prefix(tier: StorageTier) -> None:
    for key in (b"s\x00x\x00a", b"s\x00x\x00b", b"s\x00y\x00a", b"b\x00x\x00a", b"s*x"):
        tier.put(key, b"v")
    assert set(tier.keys(b"s\x00x\x00")) == {b"s\x00x\x00a", b"s\x00x\x00b"}
    assert set(tier.keys(b"s*")) == {b"s*x"}  # glob characters are literals
    assert len(set(tier.keys())) == 5


def test_used_bytes_follow_puts_and_deletes(tier: StorageTier, make_payload) -> None:
    empty = tier.used_bytes()
    tier.put(b"k", make_payload(200_000))
    grown = tier.used_bytes()
    assert grown > empty
    tier.delete(b"k")
    assert tier.used_bytes() < grown


def test_stats_count_operations(tier: StorageTier) -> None:
    tier.put(b"a", b"12345")
    tier.put(b"b", b"678")
    tier.get(b"a")
    tier.get(b"missing")
    stats = tier.stats()
    assert isinstance(stats, TierStats)
    assert (stats.puts, stats.hits, stats.misses) == (2, 1, 1)
    assert (stats.bytes_in, stats.bytes_out) == (8, 5)
    assert stats.checksum_failures == 0


def test_get_prefix_reads_the_start_of_the_value(tier: StorageTier, make_payload) -> None:
    value = make_payload(300_000, seed=4)
    tier.put(b"k", value)
    assert tier.get_prefix(b"k", 100) == value[:100]
    assert tier.get_prefix(b"k", 10**7) == value


def test_corrupt_record_is_counted_removed_and_a_miss(subject: TierUnderTest, make_payload) -> None:
    tier = subject.tier
    tier.put(b"bad", make_payload(10_000, seed=5))
    tier.put(b"good", b"intact")
    subject.corrupt(b"bad")
    assert tier.get(b"bad") is None
    assert tier.stats().checksum_failures == 1
    assert not tier.contains(b"bad")
    assert bytes(tier.get(b"good")) == b"intact"


def split_record(head: bytes, tail: bytes) -> SealedRecord:
    """A record sealed as a put's is: the tail's checksum handed in, never computed here."""
    return SealedRecord(split_prefix(head, len(tail), xxhash.xxh3_64_intdigest(tail)) + tail)


def test_a_sealed_record_is_stored_as_the_body_it_seals(tier: StorageTier, make_payload) -> None:
    head, tail = b"head" * 10, make_payload(300_000, seed=6)
    record = split_record(head, tail)
    assert len(record) == len(head) + len(tail)
    tier.put(b"k", record)
    assert bytes(tier.get(b"k")) == head + tail
    assert tier.get_prefix(b"k", len(head)) == head
    assert tier.stats().bytes_in == len(head) + len(tail)


def test_a_sealed_record_whose_tail_does_not_match_its_checksum_is_a_miss(
    tier: StorageTier, make_payload
) -> None:
    tail = bytearray(make_payload(10_000, seed=7))
    record = split_record(b"head", bytes(tail))
    tail[-1] ^= 0xFF  # the bytes changed after their checksum was taken
    prefix = bytes(record.record)[: len(record.record) - len(tail)]
    try:
        tier.put(b"k", SealedRecord(prefix + bytes(tail)))
    except CorruptPayload:  # a compressing tier opens the record to compress it
        assert not tier.contains(b"k")
    else:
        assert tier.get(b"k") is None and tier.stats().checksum_failures == 1
    tier.put(b"good", split_record(b"h", b"intact"))
    assert bytes(tier.get(b"good")) == b"hintact"


def test_close_is_idempotent_and_final(tier: StorageTier) -> None:
    tier.put(b"k", b"v")
    tier.close()
    tier.close()
    with pytest.raises(StoreUnavailable):
        tier.get(b"k")
