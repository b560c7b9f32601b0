"""LMDB faults: restarts, bytes flipped on disk, a full map (tier and store level)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from kvsplice.common.errors import ResourceExhausted
from kvsplice.storage.config import LMDBTierConfig, MemoryTierConfig, StoreConfig
from kvsplice.storage.lmdb_tier import LMDBTier
from kvsplice.storage.memory_tier import MemoryTier
from kvsplice.storage.tiered_store import TieredStore

MARKER = b"<<kvsplice-corruption-marker>>"


def make_lmdb(path: Path, map_size_bytes: int = 8 << 20, **kwargs) -> LMDBTier:
    return LMDBTier(LMDBTierConfig(str(path), map_size_bytes=map_size_bytes, sync=False, **kwargs))


def flip_marker_on_disk(path: Path) -> None:
    data_file = path / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    position = raw.find(MARKER)
    assert position >= 0 and raw.find(MARKER, position + 1) < 0, "marker must occur once"
    raw[position + 5] ^= 0xFF
    data_file.write_bytes(bytes(raw))


def test_records_survive_close_and_reopen(tmp_path: Path, make_payload) -> None:
    tier = make_lmdb(tmp_path)
    values = {bytes([i]) * 4: make_payload(10_000 * i, seed=i) for i in range(1, 6)}
    for key, value in values.items():
        tier.put(key, value)
    tier.close()
    reopened = make_lmdb(tmp_path)
    assert {key: reopened.get(key) for key in values} == values
    reopened.close()


def test_bytes_flipped_on_disk_read_as_a_counted_miss_and_are_removed(
    tmp_path: Path, make_payload
) -> None:
    tier = make_lmdb(tmp_path)
    good = {b"good-1": make_payload(20_000, seed=1), b"good-2": make_payload(300, seed=2)}
    for key, value in good.items():
        tier.put(key, value)
    tier.put(b"victim", make_payload(10_000, seed=3) + MARKER + make_payload(10_000, seed=4))
    tier.close()

    flip_marker_on_disk(tmp_path)
    reopened = make_lmdb(tmp_path)
    assert reopened.get(b"victim") is None
    assert reopened.stats().checksum_failures == 1
    assert not reopened.contains(b"victim")
    assert reopened.get(b"victim") is None
    assert reopened.stats().checksum_failures == 1  # removed: counted once, not on every read
    assert {key: reopened.get(key) for key in good} == good
    reopened.close()


def test_a_full_map_raises_resource_exhausted(tmp_path: Path, make_payload) -> None:
    tier = make_lmdb(tmp_path, map_size_bytes=256 * 1024)
    with pytest.raises(ResourceExhausted):
        for i in range(100):
            tier.put(b"k%d" % i, make_payload(32_000, seed=i))
    assert 0 < len(list(tier.keys())) < 100
    tier.close()


def test_keys_iterate_across_batches_and_prefixes(tmp_path: Path) -> None:
    tier = make_lmdb(tmp_path)
    for i in range(2500):
        tier.put(b"a%05d" % i, b"")
    tier.put(b"b", b"")
    assert list(tier.keys(b"a")) == [b"a%05d" % i for i in range(2500)]
    assert len(list(tier.keys())) == 2501
    tier.close()


def make_store(path: Path, map_size_bytes: int, removed: list) -> TieredStore:
    config = StoreConfig(
        memory=MemoryTierConfig(max_bytes=1 << 20),
        lmdb=LMDBTierConfig(str(path), map_size_bytes=map_size_bytes, sync=False),
    )
    tiers = [MemoryTier(config.memory), make_lmdb(path, map_size_bytes)]
    store = TieredStore(config, tiers)
    store.add_removal_listener(removed.append)
    return store


def test_store_evicts_least_recently_used_when_the_map_is_full(
    tmp_path: Path, make_segment
) -> None:
    removed: list = []
    store = make_store(tmp_path, 1 << 20, removed)
    segments = [make_segment(token_ids=(i,), nbytes=150_000, seed=i) for i in range(12)]
    store.put(*segments[0])
    store.put(*segments[1])
    for meta, payload in segments[2:]:
        store.get(segments[0][0].namespace, segments[0][0].context_key)  # keep #0 hot
        store.put(meta, payload)
    assert removed, "a 1 MiB map cannot hold 12 segments of 150 kB"
    assert segments[0][0] not in removed and segments[1][0] in removed
    assert store.stats().removals["capacity"] == len(removed)
    for meta, payload in segments:
        stored = store.get(meta.namespace, meta.context_key)
        assert (stored is None) == (meta in removed)
        assert stored is None or bytes(stored.payload) == payload
    store.close()


def test_store_refuses_when_every_segment_is_leased(tmp_path: Path, make_segment) -> None:
    removed: list = []
    store = make_store(tmp_path, 512 * 1024, removed)
    with ExitStack() as leases:
        with pytest.raises(ResourceExhausted, match="no unleased segment"):
            for i in range(50):
                meta, payload = make_segment(token_ids=(i,), nbytes=100_000, seed=i)
                store.put(meta, payload)
                assert leases.enter_context(store.reading(meta.namespace, meta.context_key))
        assert removed == []
    store.put(*make_segment(token_ids=(999,), nbytes=100_000))
    assert len(removed) >= 1 and store.stats().removals["capacity"] == len(removed)
    store.close()


def test_the_map_is_opened_with_readahead_so_puts_write_into_large_folios(
    tmp_path: Path,
) -> None:
    # NOTE: without readahead (MADV_RANDOM) every page of the map is a 4 KiB page-cache
    # folio: after each group fsync a put into reused pages takes one write fault per page
    # (measured: ~4x the CPU of LMDB's copy; docs/results.md, "Store put path").
    tier = make_lmdb(tmp_path)
    try:
        assert tier._env.flags()["readahead"]
    finally:
        tier.close()
