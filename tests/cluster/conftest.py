"""Fixtures of the shared-tier tests: one loopback Redis Cluster per session, sidecars on it.

The cluster (3 masters, 3 replicas, ports <= 55535) starts once; each test gets its own
key prefix, so streams and records never leak between tests.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvsplice.eval.bench.shared.local_cluster import (
    LocalCluster,
    free_port_run,
    spawn_redis,
    wait_ping,
)
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storage.config import LMDBTierConfig, RedisTierConfig

pytestmark = pytest.mark.redis


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server/redis-cli are not installed")
    started = LocalCluster(tmp_path_factory.mktemp("cluster")).start()
    yield started
    started.close()


@pytest.fixture
def key_prefix() -> str:
    return f"kvs-test-{uuid.uuid4().hex[:8]}:"


SidecarFactory = Callable[..., EmbeddedStore]


@pytest.fixture
def start_sidecar(tmp_path: Path) -> Iterator[SidecarFactory]:
    """`start_sidecar(name, redis_config)`: a sidecar with its own LMDB under tmp_path/name."""
    started: list[EmbeddedStore] = []

    def start(
        name: str,
        redis: RedisTierConfig,
        lmdb_map_bytes: int = 1 << 30,
        quota_bytes: int | None = None,
        **overrides: object,
    ) -> EmbeddedStore:
        config = loopback_config(str(tmp_path / name), admin_port=0, **overrides)
        lmdb = LMDBTierConfig(str(tmp_path / name), map_size_bytes=lmdb_map_bytes, sync=False)
        store = replace(config.store, redis=redis, lmdb=lmdb, default_quota_bytes=quota_bytes)
        config = replace(config, store=store)
        sidecar = EmbeddedStore(config)
        sidecar.start()
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        sidecar.stop()


@pytest.fixture
def single_redis(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int]]:
    """A private non-cluster redis-server (for hang tests: SIGSTOP pauses all of it)."""
    port = free_port_run(1)
    process = spawn_redis(port, tmp_path)
    wait_ping(port, 10.0)
    yield process, port
    process.kill()
    process.wait(timeout=10)
