"""What the sidecar advertises for in-place reads: an LMDB path only where a miss is final."""

from __future__ import annotations

from pathlib import Path

from kvsplice.server.data_plane import describe_data_plane
from kvsplice.storage.config import (
    LMDBTierConfig,
    MemoryTierConfig,
    RedisTierConfig,
    StoreConfig,
    build_store,
)


def test_lmdb_is_advertised_alone_but_not_in_front_of_a_shared_tier(tmp_path: Path) -> None:
    lmdb = LMDBTierConfig(str(tmp_path / "lmdb"), map_size_bytes=1 << 20, sync=False)
    build_store(StoreConfig(lmdb=lmdb)).close()  # creates the environment
    alone = describe_data_plane(StoreConfig(lmdb=lmdb))
    assert alone.lmdb_path == str((tmp_path / "lmdb").resolve())
    shared = StoreConfig(lmdb=lmdb, redis=RedisTierConfig(url="redis://127.0.0.1:1/0"))
    assert describe_data_plane(shared).lmdb_path == ""  # its LMDB misses are not final
    memory_only = StoreConfig(memory=MemoryTierConfig(max_bytes=1 << 20))
    assert describe_data_plane(memory_only).lmdb_path == ""
