"""TieredStore: write-through, promotion, TTL, quotas, leases, removal notifications, threads."""

from __future__ import annotations

import dataclasses
import random
import threading
from collections import Counter
from pathlib import Path

import pytest
import xxhash

from kvsplice.common.errors import InvalidRequest, ResourceExhausted
from kvsplice.common.segment import SegmentMeta
from kvsplice.storage.config import LMDBTierConfig, MemoryTierConfig, StoreConfig, build_store
from kvsplice.storage.keyspace import segment_key
from kvsplice.storage.lmdb_tier import LMDBTier
from kvsplice.storage.memory_tier import MemoryTier
from kvsplice.storage.record import HEADER_NBYTES
from kvsplice.storage.segment_codec import BODY_HEADER_NBYTES, encode_segment
from kvsplice.storage.tiered_store import TieredStore

NS = "tenant-a"


class FakeClock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


@dataclasses.dataclass
class Rig:
    store: TieredStore
    memory: MemoryTier
    lmdb: LMDBTier
    clock: FakeClock
    removed: list[SegmentMeta]


@pytest.fixture
def make_rig(tmp_path: Path):
    opened: list[TieredStore] = []

    def make(
        memory_bytes: int = 1 << 20,
        map_size_bytes: int = 8 << 20,
        compress: bool = False,
        cache_puts: bool = True,
        **quotas,
    ) -> Rig:
        lmdb_config = LMDBTierConfig(
            str(tmp_path / "db"), map_size_bytes=map_size_bytes, compress=compress, sync=False
        )
        config = StoreConfig(
            memory=MemoryTierConfig(max_bytes=memory_bytes),
            lmdb=lmdb_config,
            cache_puts=cache_puts,
            **quotas,
        )
        memory, lmdb = MemoryTier(config.memory), LMDBTier(config.lmdb)
        clock = FakeClock()
        store = TieredStore(config, [memory, lmdb], clock=clock)
        removed: list[SegmentMeta] = []
        store.add_removal_listener(removed.append)
        opened.append(store)
        return Rig(store, memory, lmdb, clock, removed)

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def rig(make_rig) -> Rig:
    return make_rig()


def key_of(meta: SegmentMeta) -> bytes:
    return segment_key(meta.namespace, meta.context_key)


def test_put_writes_through_every_tier(rig: Rig, make_segment) -> None:
    meta, payload = make_segment()
    rig.store.put(meta, payload)
    assert rig.memory.contains(key_of(meta)) and rig.lmdb.contains(key_of(meta))
    stored = rig.store.get(NS, meta.context_key)
    assert stored.meta == meta and bytes(stored.payload) == payload


def test_by_default_a_put_lives_in_lmdb_alone_until_a_read_promotes_it(
    make_rig, make_segment
) -> None:
    rig = make_rig(cache_puts=False)
    meta, payload = make_segment()
    rig.store.put(meta, payload)
    assert not rig.memory.contains(key_of(meta)) and rig.lmdb.contains(key_of(meta))
    assert bytes(rig.store.get(NS, meta.context_key).payload) == payload
    assert rig.memory.contains(key_of(meta))  # promoted by the read
    assert not StoreConfig(memory=MemoryTierConfig(max_bytes=1)).cache_puts  # the default


def test_a_lower_tier_hit_is_promoted(rig: Rig, make_segment) -> None:
    meta, payload = make_segment()
    rig.store.put(meta, payload)
    rig.memory.delete(key_of(meta))
    assert bytes(rig.store.get(NS, meta.context_key).payload) == payload
    assert rig.memory.contains(key_of(meta))
    hits_before = rig.lmdb.stats().hits
    rig.store.get(NS, meta.context_key)
    assert rig.lmdb.stats().hits == hits_before  # served by memory now


def test_a_stale_cached_version_is_never_served(rig: Rig, make_segment) -> None:
    old_meta, old_payload = make_segment(seed=1)
    new_meta, new_payload = make_segment(seed=2)
    rig.store.put(new_meta, new_payload)
    rig.memory.put(key_of(old_meta), encode_segment(old_meta, old_payload))  # a cache left behind
    stored = rig.store.get(NS, new_meta.context_key)
    assert stored.meta == new_meta and bytes(stored.payload) == new_payload
    assert rig.removed == []


def test_overwrite_replaces_and_is_not_a_removal(rig: Rig, make_segment) -> None:
    rig.store.put(*make_segment(seed=1))
    meta, payload = make_segment(seed=2)
    rig.store.put(meta, payload)
    assert bytes(rig.store.get(NS, meta.context_key).payload) == payload
    assert rig.removed == [] and len(list(rig.store.iter_meta())) == 1


def test_put_rejects_a_payload_that_disagrees_with_its_meta(rig: Rig, make_segment) -> None:
    meta, payload = make_segment()
    with pytest.raises(InvalidRequest, match="checksum"):
        rig.store.put(meta, payload[:-1] + bytes([payload[-1] ^ 1]))
    with pytest.raises(InvalidRequest, match="bytes"):
        rig.store.put(meta, payload + b"x")
    assert rig.store.get(NS, meta.context_key) is None


def test_ttl_expiry_deletes_and_misses(rig: Rig, make_segment) -> None:
    meta, payload = make_segment(ttl_s=10.0, created_at_s=1000.0)
    rig.store.put(meta, payload)
    rig.clock.now_s = 1009.0
    assert rig.store.get(NS, meta.context_key) is not None
    rig.clock.now_s = 1010.5
    assert rig.store.get(NS, meta.context_key) is None
    assert rig.removed == [meta]
    assert not rig.lmdb.contains(key_of(meta)) and not rig.memory.contains(key_of(meta))
    assert rig.store.get_meta(NS, meta.context_key) is None
    assert rig.removed == [meta] and rig.store.stats().removals["ttl"] == 1


def test_sweep_removes_only_the_expired(rig: Rig, make_segment) -> None:
    short = [make_segment(token_ids=(i,), ttl_s=5.0) for i in range(3)]
    keep = [make_segment(token_ids=(9,), ttl_s=50.0), make_segment(token_ids=(10,))]
    for meta, payload in short + keep:
        rig.store.put(meta, payload)
    rig.clock.now_s = 1006.0
    assert rig.store.sweep_expired() == 3
    assert sorted(m.token_ids for m in rig.removed) == [(0,), (1,), (2,)]
    assert rig.store.sweep_expired() == 0
    assert {m.token_ids for m in rig.store.iter_meta()} == {(9,), (10,)}


def test_a_lease_defers_ttl_removal_until_it_ends(rig: Rig, make_segment) -> None:
    meta, payload = make_segment(ttl_s=10.0)
    rig.store.put(meta, payload)
    with rig.store.reading(NS, meta.context_key) as stored:
        rig.clock.now_s = 2000.0
        assert rig.store.sweep_expired() == 0
        assert rig.store.get(NS, meta.context_key) is None  # expired for new readers
        assert rig.removed == [] and rig.lmdb.contains(key_of(meta))
        assert bytes(stored.payload) == payload
    assert rig.removed == [meta]
    assert not rig.lmdb.contains(key_of(meta))


def test_quota_is_a_hard_cap_that_evicts_the_namespace_lru(make_rig, make_segment) -> None:
    segments = [make_segment(token_ids=(i,), nbytes=10_000, seed=i) for i in range(6)]
    body_nbytes = len(encode_segment(*segments[0]))
    rig = make_rig(namespace_quota_bytes={NS: 3 * body_nbytes})
    other = make_segment(namespace="tenant-b", nbytes=10_000)
    rig.store.put(*other)
    for meta, payload in segments:
        rig.store.put(meta, payload)
        rig.store.get(NS, segments[0][0].context_key)  # keep #0 hot
        assert rig.store.namespace_usage()[NS].bytes <= 3 * body_nbytes
    assert [m.token_ids for m in rig.removed] == [(1,), (2,), (3,)]
    assert rig.store.get("tenant-b", other[0].context_key) is not None
    assert rig.store.stats().removals["quota"] == 3
    with pytest.raises(ResourceExhausted, match="quota"):
        rig.store.put(*make_segment(token_ids=(99,), nbytes=4 * body_nbytes))


def test_quota_refuses_while_the_namespace_is_leased(make_rig, make_segment) -> None:
    first, second = (
        make_segment(token_ids=(1,), nbytes=10_000),
        make_segment(token_ids=(2,), nbytes=10_000),
    )
    rig = make_rig(default_quota_bytes=len(encode_segment(*first)))
    rig.store.put(*first)
    with rig.store.reading(NS, first[0].context_key), pytest.raises(ResourceExhausted):
        rig.store.put(*second)
    rig.store.put(*second)
    assert rig.removed == [first[0]]


def test_removal_listener_runs_once_per_removal_never_for_cache_drops(
    make_rig, make_segment
) -> None:
    rig = make_rig(memory_bytes=30_000)
    segments = [make_segment(token_ids=(i,), nbytes=10_000, seed=i) for i in range(8)]
    for meta, payload in segments:
        rig.store.put(meta, payload)
    assert rig.memory.stats().evictions > 0 and rig.removed == []
    assert rig.store.delete(NS, segments[0][0].context_key) is True
    assert rig.store.delete(NS, segments[0][0].context_key) is False
    assert rig.removed == [segments[0][0]]


def test_a_record_lost_from_the_durable_tier_is_a_removal(rig: Rig, make_segment) -> None:
    meta, payload = make_segment()
    rig.store.put(meta, payload)
    rig.memory.delete(key_of(meta))
    with rig.lmdb._env.begin(write=True, db=rig.lmdb._db) as txn:  # bit rot
        raw = bytearray(txn.get(key_of(meta)))
        raw[-1] ^= 0xFF
        txn.put(key_of(meta), bytes(raw))
    assert rig.store.get(NS, meta.context_key) is None
    assert rig.store.get(NS, meta.context_key) is None
    assert rig.removed == [meta] and rig.lmdb.stats().checksum_failures == 1


def test_namespaces_are_isolated(rig: Rig, make_segment) -> None:
    meta_a, payload_a = make_segment(namespace="tenant-a", seed=1)
    meta_b, payload_b = make_segment(namespace="tenant-b", seed=2)
    assert meta_a.context_key == meta_b.context_key
    rig.store.put(meta_a, payload_a)
    assert rig.store.get("tenant-b", meta_a.context_key) is None
    rig.store.put(meta_b, payload_b)
    rig.store.delete("tenant-a", meta_a.context_key)
    assert bytes(rig.store.get("tenant-b", meta_b.context_key).payload) == payload_b
    with pytest.raises(InvalidRequest):
        rig.store.get("bad\x00namespace", meta_a.context_key)


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "zstd"])
def test_reopening_rebuilds_the_catalog_from_the_durable_tier(
    make_rig, make_segment, compress: bool
) -> None:
    rig = make_rig(compress=compress)
    segments = [make_segment(token_ids=(i,), created_at_s=1000.0 + i, seed=i) for i in range(5)]
    for meta, payload in segments:
        rig.store.put(meta, payload)
    rig.store.put_blob(NS, "anchor/1", b"blob")
    rig.store.close()
    reopened = make_rig(compress=compress)
    assert sorted(reopened.store.iter_meta(), key=lambda m: m.created_at_s) == [
        m for m, _ in segments
    ]
    assert reopened.store.list_segments(NS, 1, 2) == [segments[1][0], segments[2][0]]
    assert bytes(reopened.store.get(NS, segments[4][0].context_key).payload) == segments[4][1]
    assert reopened.store.get_blob(NS, "anchor/1") == b"blob"


def test_reopening_reads_meta_only_and_drops_corrupt_meta(make_rig, make_segment) -> None:
    rig = make_rig()
    (bad, bad_payload), (good, good_payload) = (
        make_segment(token_ids=(1,)),
        make_segment(token_ids=(2,)),
    )
    rig.store.put(bad, bad_payload)
    rig.store.put(good, good_payload)
    with rig.lmdb._env.begin(write=True, db=rig.lmdb._db) as txn:  # flip a byte of bad's meta
        raw = bytearray(txn.get(key_of(bad)))
        raw[HEADER_NBYTES + BODY_HEADER_NBYTES + 3] ^= 0xFF
        txn.put(key_of(bad), bytes(raw))
    rig.store.close()
    reopened = make_rig()
    assert reopened.lmdb.stats().bytes_out == 0  # no payload was read to rebuild the catalog
    assert list(reopened.store.iter_meta()) == [good]
    assert not reopened.lmdb.contains(key_of(bad))
    assert reopened.store.stats().removals["lost"] == 1


def test_blobs_have_their_own_key_space_and_ttl(rig: Rig, make_segment) -> None:
    meta, payload = make_segment()
    rig.store.put(meta, payload)
    rig.store.put_blob(NS, meta.context_key.hex(), b"not a segment")
    rig.store.put_blob(NS, "pool/a", b"A", ttl_s=5.0)
    rig.store.put_blob("tenant-b", "pool/b", b"B")
    assert bytes(rig.store.get(NS, meta.context_key).payload) == payload
    assert sorted(rig.store.iter_blob_names(NS, "pool/")) == ["pool/a"]
    assert rig.store.get_blob("tenant-b", "pool/a") is None
    rig.clock.now_s = 1006.0
    assert rig.store.get_blob(NS, "pool/a") is None
    assert rig.store.delete_blob("tenant-b", "pool/b") is True
    assert rig.store.get_blob("tenant-b", "pool/b") is None
    assert list(rig.store.iter_meta()) == [meta]


def test_usage_and_stats_count_lookups(rig: Rig, make_segment) -> None:
    meta, payload = make_segment(nbytes=5000)
    rig.store.put(meta, payload)
    rig.store.get(NS, meta.context_key)
    rig.store.get(NS, b"\x01" * 16)
    usage = rig.store.namespace_usage()[NS]
    assert (usage.segments, usage.hits, usage.misses) == (1, 1, 1)
    assert usage.bytes == len(encode_segment(meta, payload))
    stats = rig.store.stats()
    assert set(stats.tiers) == {"memory", "lmdb"} and stats.num_segments == 1
    assert stats.total.puts == stats.tiers["memory"].puts + stats.tiers["lmdb"].puts


def test_a_memory_only_store_reports_budget_evictions_as_removals(make_segment) -> None:
    store = build_store(StoreConfig(memory=MemoryTierConfig(max_bytes=25_000)))
    removed: list[SegmentMeta] = []
    store.add_removal_listener(removed.append)
    segments = [make_segment(token_ids=(i,), nbytes=10_000, seed=i) for i in range(3)]
    for meta, payload in segments:
        store.put(meta, payload)
    assert removed == [segments[0][0]]
    assert store.get(NS, segments[0][0].context_key) is None
    assert [m.token_ids for m in store.iter_meta()] == [(1,), (2,)]
    store.close()


def test_sixteen_threads_never_read_a_torn_or_foreign_payload(make_rig, make_segment) -> None:
    rig = make_rig(memory_bytes=15_000, map_size_bytes=4 << 20, default_quota_bytes=20_000)
    versions = {
        k: [make_segment(token_ids=(k,), nbytes=4000, seed=10 * k + v) for v in range(3)]
        for k in range(8)
    }
    errors: list[BaseException] = []
    outcomes: Counter[str] = Counter()

    def check(stored, expected_key: bytes) -> None:
        if stored is not None:
            assert stored.meta.context_key == expected_key
            assert len(stored.payload) == stored.meta.payload_nbytes
            assert xxhash.xxh3_64_intdigest(stored.payload) == stored.meta.checksum

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                k = rng.randrange(8)
                meta, payload = versions[k][rng.randrange(3)]
                op = rng.choice(["put", "put", "get", "get", "read", "delete"])
                if op == "put":
                    try:
                        rig.store.put(meta, payload)
                    except ResourceExhausted:
                        outcomes["refused"] += 1
                elif op == "get":
                    check(rig.store.get(NS, meta.context_key), meta.context_key)
                elif op == "read":
                    with rig.store.reading(NS, meta.context_key) as stored:
                        check(stored, meta.context_key)
                else:
                    rig.store.delete(NS, meta.context_key)
                outcomes[op] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert rig.store.stats().removals["quota"] > 0 and outcomes["read"] > 0
    catalog_keys = {key_of(m) for m in rig.store.iter_meta()}
    assert catalog_keys == set(rig.lmdb.keys(b"s\x00"))
    assert set(rig.memory.keys()) <= catalog_keys
    assert (
        rig.store.namespace_usage().get(NS) is None
        or rig.store.namespace_usage()[NS].bytes <= 20_000
    )
    for key in catalog_keys:
        stored = rig.store.get(NS, key[-16:])
        check(stored, key[-16:])
