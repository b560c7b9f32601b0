"""The LMDB tier's fsync window: what waits unsynced stays within its bound, the syncer
groups commits, close syncs the rest; the tier uses it at the default and not per commit.
Counted, never timed (a wait for the syncer has a generous deadline only)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvsplice.common.errors import StoreUnavailable
from kvsplice.storage.config import LMDBTierConfig, describe_durability
from kvsplice.storage.lmdb_sync import SyncWindow
from kvsplice.storage.lmdb_tier import LMDBTier

MIB = 1 << 20


class CountedSync:
    def __init__(self) -> None:
        self.num_calls = 0
        self.called = threading.Event()

    def __call__(self) -> None:
        self.num_calls += 1
        self.called.set()


def test_a_commit_past_the_bound_syncs_before_it_returns() -> None:
    sync = CountedSync()
    window = SyncWindow(sync, interval_s=3600.0, max_unsynced_bytes=10, name="t")
    try:
        for _ in range(3):
            window.committed(4)  # 4, 8, then 12 > 10: synced in this call
        assert sync.num_calls == 1 and window.unsynced_nbytes == 0
        window.committed(10)  # exactly the bound: allowed to wait
        assert sync.num_calls == 1 and window.unsynced_nbytes == 10
    finally:
        window.close()
    assert sync.num_calls == 2 and window.unsynced_nbytes == 0  # close syncs what is left


def test_the_syncer_groups_the_commits_of_a_window() -> None:
    sync = CountedSync()
    window = SyncWindow(sync, interval_s=0.05, max_unsynced_bytes=1 << 40, name="t")
    try:
        for _ in range(20):
            window.committed(1)
        assert sync.called.wait(30)
        assert window.unsynced_nbytes <= 20 and sync.num_calls <= 20
    finally:
        window.close()
    assert window.unsynced_nbytes == 0 and 1 <= sync.num_calls < 20


def test_a_failed_sync_fails_the_next_put() -> None:
    def broken() -> None:
        raise OSError("disk gone")

    window = SyncWindow(broken, interval_s=0.01, max_unsynced_bytes=1 << 40, name="t")
    with pytest.raises(StoreUnavailable, match="disk gone"):
        for _ in range(10_000):
            window.committed(1)
            threading.Event().wait(0.01)
    with pytest.raises(OSError):
        window.close()


def test_the_tier_syncs_by_window_at_the_default_and_per_commit_at_interval_0(
    tmp_path: Path,
) -> None:
    default = LMDBTierConfig(str(tmp_path / "a"), map_size_bytes=64 * MIB)
    assert default.grouped_sync and "fsync every 100 ms" in describe_durability(default)
    tier = LMDBTier(default)
    try:
        tier.put(b"k", b"x" * MIB)
        window = tier.sync_window
        assert window is not None and window.unsynced_nbytes <= default.max_unsynced_bytes
    finally:
        tier.close()
    assert window.unsynced_nbytes == 0
    per_commit = LMDBTierConfig(str(tmp_path / "b"), sync_interval_ms=0)
    off = LMDBTierConfig(str(tmp_path / "c"), sync=False)
    for config in (per_commit, off):
        assert not config.grouped_sync
        tier = LMDBTier(config)
        assert tier.sync_window is None
        tier.close()
    assert describe_durability(per_commit).startswith("fsync every commit")
    with pytest.raises(ValueError, match="sync_interval_ms"):
        LMDBTierConfig("x", sync_interval_ms=-1)
