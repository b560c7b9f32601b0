"""Counters kept with the tiers: they survive reopening the LMDB environment, stay out of the
segments and faster tiers, make room in a full tier, and a broken record is skipped."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvsplice.common.errors import CorruptPayload, ResourceExhausted
from kvsplice.common.segment import SegmentMeta
from kvsplice.storage.config import LMDBTierConfig, MemoryTierConfig, StoreConfig, build_store
from kvsplice.storage.counter_records import decode_counts, encode_counts
from kvsplice.storage.keyspace import counters_key
from kvsplice.storage.tiered_store import TieredStore

Segment = Callable[..., tuple[SegmentMeta, bytes]]


def open_store(path: Path, map_size_bytes: int = 8 << 20) -> TieredStore:
    lmdb = LMDBTierConfig(str(path), map_size_bytes=map_size_bytes, sync=False)
    memory = MemoryTierConfig(max_bytes=1 << 20)
    return build_store(StoreConfig(memory=memory, lmdb=lmdb, cache_puts=True))


def test_counts_survive_reopening_and_stay_out_of_the_segments(
    tmp_path: Path, make_segment: Segment
) -> None:
    store = open_store(tmp_path)
    meta, payload = make_segment()
    store.put(meta, payload)
    store.counters.save({"team-a": {"num_calls": 3, "x": 7}, "team-b": {"num_calls": 1}})
    store.counters.save({"team-a": {"num_calls": 4, "x": 9}})  # replaces team-a's only
    store.close()
    store = open_store(tmp_path)
    try:
        assert store.counters.load() == {
            "team-a": {"num_calls": 4, "x": 9},
            "team-b": {"num_calls": 1},
        }
        assert [m.segment_id for m in store.iter_meta()] == [meta.segment_id]
        assert store.stats().num_segments == 1
    finally:
        store.close()


def test_a_full_tier_makes_room_for_the_counts(tmp_path: Path, make_segment: Segment) -> None:
    store = open_store(tmp_path, map_size_bytes=1 << 20)
    durable = store._stack.durable  # filled to the last byte below
    try:
        removed: list[SegmentMeta] = []
        store.add_removal_listener(removed.append)
        for i in range(10):  # 640 KiB of segments in a 1 MiB map
            store.put(*make_segment(token_ids=(i + 1,), nbytes=64 << 10, seed=i))
        num_fillers = 0
        for nbytes in (16384, 4096, 1024, 256, 64, 16):  # the rest with what is no segment
            while True:
                try:
                    durable.put(b"filler-%d" % num_fillers, bytes(nbytes))
                except ResourceExhausted:
                    break
                num_fillers += 1
        assert not removed
        store.counters.save({"team-a": {"num_calls": 1}})  # a segment makes room for it
        assert store.counters.load() == {"team-a": {"num_calls": 1}}
        assert len(removed) == 1
    finally:
        store.close()


def test_a_record_that_does_not_decode_is_skipped(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    tiers = store._stack.tiers  # what a damaged or foreign record looks like
    try:
        store.counters.save({"team-a": {"num_calls": 2}})
        tiers[-1].put(counters_key("team-b"), b"not json")
        tiers[-1].put(counters_key("team-c"), encode_counts({"num_calls": -1}))
        assert store.counters.load() == {"team-a": {"num_calls": 2}}
        assert not tiers[0].contains(counters_key("team-a"))  # never in the memory tier
    finally:
        store.close()


@pytest.mark.parametrize(
    "body", [b"{}", b'{"version": 2, "counts": {}}', b'{"version": 1, "counts": {"a": 1.5}}']
)
def test_decoding_refuses_what_is_not_counts(body: bytes) -> None:
    with pytest.raises(CorruptPayload):
        decode_counts(body)
    assert decode_counts(encode_counts({"a": 1})) == {"a": 1}
