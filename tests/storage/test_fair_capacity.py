"""Capacity with several tenants: a full LMDB tier evicts from the namespace over its fair
share first (the writer's own oldest once it holds its share), never silently empties
another tenant, and every eviction and refused put is counted per namespace. Also: one
process per LMDB directory, and keys written once (`put_if_absent`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsplice.common.errors import ResourceExhausted, StoreUnavailable
from kvsplice.storage.config import LMDBTierConfig, MemoryTierConfig, StoreConfig, build_store
from kvsplice.storage.lmdb_tier import LMDBTier
from kvsplice.storage.tiered_store import TieredStore

SEGMENT_NBYTES = 60 * 1024
MAP_NBYTES = 4 << 20  # ~60 segments of 60 KiB


def lmdb_store(path: Path, **quotas: object) -> TieredStore:
    config = LMDBTierConfig(str(path), map_size_bytes=MAP_NBYTES, sync=False)
    return build_store(StoreConfig(lmdb=config, **quotas))  # type: ignore[arg-type]


def fill(store: TieredStore, make_segment, namespace: str, start: int, count: int) -> list[bytes]:
    """Put `count` segments of `namespace` (oldest first); their context keys."""
    keys = []
    for i in range(start, start + count):
        meta, payload = make_segment(
            namespace=namespace, token_ids=(i,), nbytes=SEGMENT_NBYTES, seed=i
        )
        store.put(meta, payload)
        keys.append(meta.context_key)
    return keys


def held(store: TieredStore, namespace: str, keys: list[bytes]) -> list[bool]:
    return [store.get_meta(namespace, key) is not None for key in keys]


def test_a_writer_takes_room_from_the_largest_tenant_only_down_to_an_even_share(
    tmp_path: Path, make_segment
) -> None:
    store = lmdb_store(tmp_path / "db")
    try:
        old = fill(store, make_segment, "old", 0, 40)  # well over half the map
        new = fill(store, make_segment, "new", 1000, 120)  # writes on and on
        usage = store.namespace_usage()
        old_kept, new_kept = usage["old"].segments, usage["new"].segments
        # "old" keeps its share (its newest segments); "new" paid with its own oldest.
        assert old_kept >= 0.4 * (old_kept + new_kept), (old_kept, new_kept)
        assert held(store, "old", old)[-old_kept:] == [True] * old_kept
        assert held(store, "new", new)[-new_kept:] == [True] * new_kept
        assert not any(held(store, "new", new[:20]))
        pressure = store.namespace_pressure()
        assert pressure["new"].removals["capacity"] == 120 - new_kept
        assert pressure["old"].removals["capacity"] == 40 - old_kept
    finally:
        store.close()


def test_quota_evictions_and_refusals_are_counted_per_namespace(
    tmp_path: Path, make_segment
) -> None:
    store = lmdb_store(tmp_path / "db", namespace_quota_bytes={"small": 3 * SEGMENT_NBYTES})
    try:
        fill(store, make_segment, "small", 0, 5)
        big, payload = make_segment(namespace="small", token_ids=(99,), nbytes=4 * SEGMENT_NBYTES)
        with pytest.raises(ResourceExhausted):
            store.put(big, payload)
        pressure = store.namespace_pressure()["small"]
        assert pressure.removals["quota"] >= 2 and pressure.refusals == {"quota": 1}
    finally:
        store.close()


def test_a_segment_larger_than_the_whole_tier_is_a_counted_refusal(make_segment) -> None:
    store = build_store(StoreConfig(memory=MemoryTierConfig(max_bytes=2 * SEGMENT_NBYTES)))
    try:
        meta, payload = make_segment(namespace="wide", nbytes=3 * SEGMENT_NBYTES)
        with pytest.raises(ResourceExhausted, match="exceed"):
            store.put(meta, payload)
        assert store.get_meta("wide", meta.context_key) is None
        assert store.namespace_pressure()["wide"].refusals == {"capacity": 1}
    finally:
        store.close()


def test_put_if_absent_writes_once(tmp_path: Path, make_segment) -> None:
    store = lmdb_store(tmp_path / "db")
    try:
        meta, payload = make_segment()
        assert store.put_if_absent(meta, payload) is None
        other, other_payload = make_segment(seed=5)
        assert store.put_if_absent(other, other_payload) == meta
        stored = store.get(meta.namespace, meta.context_key)
        assert stored is not None and bytes(stored.payload) == payload
    finally:
        store.close()


def test_one_process_per_lmdb_directory(tmp_path: Path) -> None:
    config = LMDBTierConfig(str(tmp_path / "db"), sync=False)
    first = LMDBTier(config)
    with pytest.raises(StoreUnavailable, match="in use by another kvsplice process"):
        LMDBTier(config)
    first.close()
    LMDBTier(config).close()  # released with the first
