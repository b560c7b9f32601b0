"""Redis tier faults: a server that dies, is full or unreachable; prefixes; TTL passthrough."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from kvsplice.common.errors import ResourceExhausted, StoreUnavailable
from kvsplice.eval.bench.shared.local_cluster import spawn_redis, wait_ping
from kvsplice.storage.config import RedisTierConfig
from kvsplice.storage.redis_tier import RedisTier, escape_glob

pytestmark = pytest.mark.redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def start_redis(tmp_path: Path) -> Iterator[Callable[..., tuple[subprocess.Popen, int]]]:
    """Starts private redis-servers (no persistence) and kills them afterwards."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    started: list[subprocess.Popen] = []

    def start(*extra: str) -> tuple[subprocess.Popen, int]:
        port = free_port()
        process = spawn_redis(port, tmp_path, *extra)
        started.append(process)
        wait_ping(port, timeout_s=10)
        return process, port

    yield start
    for process in started:
        process.kill()
        process.wait(timeout=10)


def make_tier(port: int, **kwargs) -> RedisTier:
    config = RedisTierConfig(url=f"redis://127.0.0.1:{port}/0", socket_timeout_s=1.0, **kwargs)
    return RedisTier(config)


def test_a_killed_server_raises_store_unavailable_never_garbage(start_redis) -> None:
    process, port = start_redis()
    tier = make_tier(port)
    tier.put(b"k", b"value")
    assert bytes(tier.get(b"k")) == b"value"
    process.kill()
    process.wait(timeout=10)
    operations = [
        lambda: tier.get(b"k"),
        lambda: tier.get_prefix(b"k", 3),
        lambda: tier.put(b"k", b"other"),
        lambda: tier.delete(b"k"),
        lambda: tier.contains(b"k"),
        lambda: list(tier.keys()),
    ]
    for operation in operations:
        with pytest.raises(StoreUnavailable):
            operation()
    tier.close()


def test_an_unreachable_server_starts_degraded_and_connects_when_it_appears(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    with caplog.at_level("WARNING"):
        tier = make_tier(port, probe_interval_s=0.05)
    assert [r.message for r in caplog.records if "unreachable" in r.message] == [
        caplog.records[0].message
    ]  # one line, no traceback
    assert tier.connection.breaker.is_open
    # fails fast while degraded: the open breaker refuses the call, no connection tried
    with pytest.raises(StoreUnavailable, match="is degraded"):
        tier.get(b"k")
    process = spawn_redis(port, tmp_path)
    try:
        wait_ping(port, timeout_s=10)
        deadline = time.monotonic() + 5
        while tier.connection.breaker.is_open and time.monotonic() < deadline:
            time.sleep(0.02)
        tier.put(b"k", b"value")
        assert bytes(tier.get(b"k")) == b"value"
    finally:
        tier.close()
        process.kill()
        process.wait(timeout=10)


def test_a_full_server_raises_resource_exhausted(start_redis) -> None:
    _, port = start_redis("--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    tier = make_tier(port)
    with pytest.raises(ResourceExhausted):
        for i in range(10):
            tier.put(b"k%d" % i, b"x" * (1 << 20))
    tier.close()


def test_ttl_is_passed_through(redis_client: redis.Redis, redis_prefix: str) -> None:
    tier = RedisTier(RedisTierConfig(key_prefix=redis_prefix, ttl_s=30.0))
    tier.put(b"k", b"v")
    assert 0 < redis_client.pttl(tier._full(b"k")) <= 30_000
    tier.close()


def test_prefixes_isolate_tiers(redis_prefix: str) -> None:
    first = RedisTier(RedisTierConfig(key_prefix=redis_prefix + "one:"))
    second = RedisTier(RedisTierConfig(key_prefix=redis_prefix + "two:"))
    first.put(b"k", b"1")
    assert second.get(b"k") is None and list(second.keys()) == []
    assert list(first.keys()) == [b"k"]
    first.close()
    second.close()


def test_used_bytes_are_seeded_from_the_server(redis_prefix: str) -> None:
    writer = RedisTier(RedisTierConfig(key_prefix=redis_prefix))
    writer.put(b"a", b"x" * 1000)
    writer.put(b"b", b"y" * 10)
    reader = RedisTier(RedisTierConfig(key_prefix=redis_prefix))
    assert reader.used_bytes() == writer.used_bytes() > 1010
    writer.close()
    reader.close()


def test_glob_characters_are_escaped() -> None:
    assert escape_glob(b"a*b?c[d]e\\f") == b"a\\*b\\?c\\[d\\]e\\\\f"
