"""Real `kvsplice serve` processes on a real 6-node Redis Cluster (3 masters, 1 replica each,
every node a seed): a chain put through sidecar A, one master killed (each in turn), then a
sidecar C started after the failover, with empty tiers and the dead node still in its seed
list, says it caught up and finds and reads the whole chain through a client on its host.
In one variant the namespace's event history is trimmed first: C learns of nothing from the
stream, so the lookup walks the chain through the cluster's records alone."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from helpers.cluster import FINGERPRINT, NAMESPACE, chain_tokens, make_chain
from helpers.serve_process import ServeProcess, start_serve
from helpers.waiting import wait_for

from kvsplice.eval.bench.shared.local_cluster import LocalCluster, redis_client
from kvsplice.storage.redis_connection import hash_tagged
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

pytestmark = pytest.mark.redis

NUM_SEGMENTS, TOKENS_PER_SEGMENT = 24, 32  # 768 tokens
KEY_PREFIX = "kvsplice:"  # serve's default
PATIENT = StoreClientConfig(lookup_timeout_s=10.0, get_timeout_s=10.0, put_timeout_s=10.0)


@pytest.fixture
def private_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A cluster of this test's own: the failover changes its topology for good."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server/redis-cli are not installed")
    started = LocalCluster(tmp_path / "cluster").start()
    yield started
    started.close()


def start_sidecar(workdir: Path, redis_url: str) -> ServeProcess:
    tiers = ["--lmdb-path", str(workdir / "lmdb"), "--memory-mib", "64"]
    return start_serve(workdir, "--redis-url", redis_url, "--redis-cluster", *tiers)


def readyz(sidecar: ServeProcess) -> dict:
    reply = httpx.get(f"{sidecar.admin_url}/readyz", timeout=5.0)
    return {"http": reply.status_code, **reply.json()}


def settled(ready: dict) -> bool:
    shared = ready.get("shared_tier") or {}
    return ready["http"] == 200 and shared.get("state") == "connected" and shared["caught_up"]


def wait_replicated(cluster: LocalCluster, timeout_s: float = 10.0) -> None:
    """Until every replica holds its master's writes (replication is asynchronous: a master
    killed before its replica received a write loses it, whatever the sidecars do)."""

    def lag() -> int:
        total = 0
        for port in cluster.masters():
            with redis_client(port) as client:
                info = client.info("replication")
            offsets = [v["offset"] for k, v in info.items() if k.startswith("slave")]
            total += sum(info["master_repl_offset"] - o for o in offsets) if offsets else 1
        return total

    wait_for(lag, lambda n: n == 0, timeout_s=timeout_s, interval_s=0.05)


def trim_history(cluster: LocalCluster) -> None:
    """Every event of the namespace trimmed off its stream (as `stream_max_len` would)."""
    stream = hash_tagged(f"{KEY_PREFIX}events:".encode(), NAMESPACE.encode(), NAMESPACE.encode())
    with redis.RedisCluster(host="127.0.0.1", port=cluster.masters()[0]) as client:
        assert client.xtrim(stream, maxlen=0) > 0


def found_and_read(sidecar: ServeProcess, chain) -> tuple[int, int]:
    """(tokens of `chain` the sidecar finds, segments it reads back by key byte-identical)."""
    with StoreClient(sidecar.target, NAMESPACE, config=PATIENT) as client:
        found = client.lookup_prefix(FINGERPRINT, chain_tokens(chain)).num_matched_tokens
        reads = [client.get_segment(meta.context_key) for meta, _ in chain]
    return found, sum(
        read is not None and read[1] == payload
        for read, (_, payload) in zip(reads, chain, strict=True)
    )


def seeds_dead_first(cluster: LocalCluster, dead: int) -> str:
    """Every node as a seed, the dead one first (the first a client would try)."""
    ports = [dead, *(port for port in cluster.ports if port != dead)]
    return "redis://" + ",".join(f"127.0.0.1:{port}" for port in ports)


@pytest.mark.slow  # a cluster, a failover and two sidecar processes per case: ~20 s
@pytest.mark.parametrize(
    ("victim", "history"), [(0, "kept"), (1, "kept"), (2, "kept"), (0, "trimmed")]
)
def test_a_sidecar_started_after_a_failover_finds_and_reads_the_whole_chain(
    private_cluster: LocalCluster, tmp_path: Path, victim: int, history: str
) -> None:
    cluster = private_cluster
    chain = make_chain(NUM_SEGMENTS, tokens_per_segment=TOKENS_PER_SEGMENT, seed=36 + victim)
    a = start_sidecar(tmp_path / "a", cluster.url)
    c: ServeProcess | None = None
    try:
        with StoreClient(a.target, NAMESPACE, config=PATIENT) as client_a:
            assert all(client_a.put_segment(meta, payload) for meta, payload in chain)
        wait_for(lambda: readyz(a)["shared_tier"]["pending_writes"], lambda n: n == 0, 10.0)
        wait_replicated(cluster)
        dead = cluster.masters()[victim]
        cluster.kill(dead)
        cluster.wait_promoted(dead, timeout_s=30.0)
        if history == "trimmed":  # c learns nothing from the stream: records alone
            trim_history(cluster)
        c = start_sidecar(tmp_path / "c", seeds_dead_first(cluster, dead))  # empty tiers
        ready = wait_for(lambda: readyz(c), settled, timeout_s=30.0, interval_s=0.1)
        assert ready["status"] == "ready", ready
        assert found_and_read(c, chain) == (NUM_SEGMENTS * TOKENS_PER_SEGMENT, NUM_SEGMENTS)
        # the dead node stays a seed of both: neither stays degraded once the cluster is whole
        wait_for(lambda: readyz(a), settled, timeout_s=30.0, interval_s=0.1)
        assert found_and_read(a, chain) == (NUM_SEGMENTS * TOKENS_PER_SEGMENT, NUM_SEGMENTS)
    finally:
        for sidecar in (a, c):
            if sidecar is not None:
                assert sidecar.stop() == 0, sidecar.log()[-2000:]
