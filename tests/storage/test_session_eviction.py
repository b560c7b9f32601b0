"""Sessions in the real store: a full LMDB tier (and a namespace quota) evicts released
segments first and live sessions' last; without a session id eviction is exactly as today."""

from __future__ import annotations

from pathlib import Path

from kvsplice.storage.config import LMDBTierConfig, SessionConfig, StoreConfig, build_store
from kvsplice.storage.tiered_store import TieredStore

SEGMENT_NBYTES = 60 * 1024
MAP_NBYTES = 4 << 20  # ~60 segments of 60 KiB


def lmdb_store(path: Path, lease_s: float = 300.0, **fields: object) -> TieredStore:
    lmdb = LMDBTierConfig(str(path), map_size_bytes=MAP_NBYTES, sync=False)
    config = StoreConfig(lmdb=lmdb, sessions=SessionConfig(lease_s=lease_s), **fields)  # type: ignore[arg-type]
    return build_store(config, clock=lambda: 1000.0)


def fill(store: TieredStore, make_segment, start: int, count: int) -> list[bytes]:
    keys = []
    for i in range(start, start + count):
        meta, payload = make_segment(token_ids=(i,), nbytes=SEGMENT_NBYTES, seed=i)
        store.put(meta, payload)
        keys.append(meta.context_key)
    return keys


def kept(store: TieredStore, keys: list[bytes]) -> list[bool]:
    return [store.get_meta("tenant-a", key) is not None for key in keys]


def test_a_live_session_outlasts_newer_traffic_and_an_ended_one_goes_first(
    tmp_path: Path, make_segment
) -> None:
    store = lmdb_store(tmp_path / "db")
    try:
        live = fill(store, make_segment, 0, 10)
        ended = fill(store, make_segment, 100, 10)
        assert store.sessions.hold("tenant-a", "live", live).num_held == 10
        store.sessions.hold("tenant-a", "ended", ended)
        assert store.sessions.end("tenant-a", "ended")
        fresh = fill(store, make_segment, 200, 20)
        fill(store, make_segment, 300, 40)  # past the map's ~60 segments
        assert all(kept(store, live))  # oldest, but held
        assert not any(kept(store, ended))  # released: evicted before anything else
        assert not kept(store, fresh)[0]  # today's LRU order for the rest
    finally:
        store.close()


def test_the_quota_evicts_unheld_segments_before_held_ones(tmp_path: Path, make_segment) -> None:
    store = lmdb_store(tmp_path / "db", default_quota_bytes=20 * (SEGMENT_NBYTES + 4096))
    try:
        held = fill(store, make_segment, 0, 5)
        store.sessions.hold("tenant-a", "s", held)
        fill(store, make_segment, 100, 40)
        assert all(kept(store, held))
    finally:
        store.close()


def test_without_session_ids_eviction_is_exactly_as_with_sessions_off(
    tmp_path: Path, make_segment
) -> None:
    """The same puts and reads, sessions on (never named) and off: the same segments stay."""
    survivors = []
    for lease_s in (300.0, 0.0):
        store = lmdb_store(tmp_path / f"db-{lease_s}", lease_s=lease_s)
        try:
            keys = fill(store, make_segment, 0, 30)
            for key in keys[:10:2]:
                store.touch("tenant-a", key)
            keys += fill(store, make_segment, 100, 50)
            survivors.append(kept(store, keys))
            assert store.sessions.enabled is (lease_s > 0)
        finally:
            store.close()
    assert survivors[0] == survivors[1]
    assert 0 < sum(survivors[0]) < len(survivors[0])
