"""Storage configs reject bad values by name; build_store wires the configured tiers."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from kvsplice.storage.config import (
    LMDBTierConfig,
    MemoryTierConfig,
    RedisTierConfig,
    StoreConfig,
    build_store,
)
from kvsplice.storage.keyspace import segment_key


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: MemoryTierConfig(max_bytes=0), "max_bytes 0"),
        (lambda: MemoryTierConfig(max_bytes=10, policy="fifo"), "'fifo'"),
        (lambda: LMDBTierConfig(path=""), "path ''"),
        (lambda: LMDBTierConfig(path="/tmp/x", map_size_bytes=1000), "map_size_bytes 1000"),
        (lambda: RedisTierConfig(url="http://localhost"), "url scheme 'http'"),
        (lambda: RedisTierConfig(ttl_s=-1.0), "ttl_s -1.0"),
        (lambda: RedisTierConfig(key_prefix=""), "key_prefix ''"),
        (lambda: RedisTierConfig(key_prefix="a{b}:"), "holds a brace"),
        (lambda: RedisTierConfig(url="unix:///x.sock", cluster=True), "over TCP"),
        (lambda: RedisTierConfig(failure_threshold=0), "failure_threshold 0"),
        (lambda: RedisTierConfig(max_pending_publish=0), "max_pending_publish 0"),
        (lambda: StoreConfig(), "names no local tier"),
        (
            lambda: StoreConfig(memory=MemoryTierConfig(10), default_quota_bytes=0),
            "default_quota_bytes 0",
        ),
        (
            lambda: StoreConfig(memory=MemoryTierConfig(10), namespace_quota_bytes={"a b": 5}),
            "'a b'",
        ),
        (lambda: StoreConfig(memory=MemoryTierConfig(10), namespace_quota_bytes={"ok": -5}), "-5"),
    ],
)
def test_bad_values_are_named(make, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        make()


def test_quotas_fall_back_to_the_default_and_are_frozen() -> None:
    quotas = {"small": 10}
    config = StoreConfig(
        memory=MemoryTierConfig(100), namespace_quota_bytes=quotas, default_quota_bytes=50
    )
    quotas["small"] = 999
    assert config.quota_for("small") == 10 and config.quota_for("other") == 50
    with pytest.raises(TypeError):
        config.namespace_quota_bytes["small"] = 1  # type: ignore[index]


def test_build_store_stacks_memory_over_lmdb(tmp_path: Path, make_segment) -> None:
    store = build_store(
        StoreConfig(
            memory=MemoryTierConfig(max_bytes=1 << 20),
            lmdb=LMDBTierConfig(str(tmp_path / "db"), map_size_bytes=1 << 24, sync=False),
        )
    )
    meta, payload = make_segment()
    store.put(meta, payload)
    assert bytes(store.get(meta.namespace, meta.context_key).payload) == payload
    assert list(store.stats().tiers) == ["memory", "lmdb"]
    store.close()
    store.close()


@pytest.mark.redis
def test_build_store_puts_redis_behind_the_local_tiers_as_the_shared_tier(
    tmp_path: Path, make_segment, redis_client: redis.Redis, redis_prefix: str
) -> None:
    store = build_store(
        StoreConfig(
            memory=MemoryTierConfig(max_bytes=1 << 20),
            redis=RedisTierConfig(key_prefix=redis_prefix),
            lmdb=LMDBTierConfig(str(tmp_path / "db"), map_size_bytes=1 << 24, sync=False),
        )
    )
    meta, payload = make_segment()
    store.put(meta, payload)
    assert store.shared is not None and store.shared.wait_published(5.0)
    assert list(store.stats().tiers) == ["memory", "lmdb", "redis"]
    record_name = store.shared.records._full(segment_key(meta.namespace, meta.context_key))
    assert redis_client.exists(record_name)
    assert bytes(store.get(meta.namespace, meta.context_key).payload) == payload
    store.delete(meta.namespace, meta.context_key)
    assert store.shared.wait_published(5.0)
    assert not redis_client.exists(record_name)
    store.close()
