"""A shared-tier fault degrades sharing, never the sidecar: failover, a hung Redis, a late Redis."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from helpers.cluster import (
    FINGERPRINT,
    NAMESPACE,
    chain_tokens,
    health_status,
    make_chain,
    make_client,
    metric,
    readyz,
    shared_config,
)
from helpers.waiting import wait_for

from kvsplice.eval.bench.shared.load import LoadRun, LoadSpec, read_back
from kvsplice.eval.bench.shared.local_cluster import free_port_run, spawn_redis, wait_ping

pytestmark = pytest.mark.redis


def load_spec(targets: tuple[str, ...], chain, num_clients: int) -> LoadSpec:
    return LoadSpec(targets, NAMESPACE, FINGERPRINT, tuple(chain), num_clients=num_clients)


def test_a_master_killed_mid_load_loses_no_read_and_a_new_sidecar_finds_everything(
    cluster, key_prefix, start_sidecar
) -> None:
    config = shared_config(cluster.url, key_prefix)
    a, b = start_sidecar("a", config), start_sidecar("b", config)
    chain = make_chain(8)
    with make_client(a) as client_a, make_client(b) as client_b:
        assert all(client_a.put_segment(m, p) for m, p in chain)
        wait_for(
            lambda: client_b.lookup_prefix(FINGERPRINT, chain_tokens(chain)).num_matched_tokens,
            lambda n: n == len(chain_tokens(chain)),
            timeout_s=1.0,
        )
        assert read_back([b.target], NAMESPACE, chain) == 0  # B caches the chain
    load = LoadRun(load_spec((a.target, b.target), chain, num_clients=2)).start()
    time.sleep(0.5)
    victim = cluster.masters()[0]
    cluster.kill(victim)
    try:
        assert cluster.wait_promoted(victim, timeout_s=15.0) > 0.5  # the load ran through it
        time.sleep(0.5)
        load.stop()
        summary = load.summary()
        assert summary["get"]["failed_or_missed"] == 0 and summary["get"]["count"] > 0
        assert summary["lookup"]["failed_or_missed"] == 0
        assert summary["put"]["failed_or_missed"] == 0 and load.written
        for sidecar in (a, b):
            assert sidecar.server.store.shared.wait_published(10.0)
        everything = chain + load.written
        wait_for(lambda: read_back([b.target], NAMESPACE, everything), lambda n: n == 0, 5.0)
        c = start_sidecar("c", config)  # after the failover, empty local tiers
        with make_client(c) as client_c:
            match = client_c.lookup_prefix(FINGERPRINT, chain_tokens(chain))
            assert match.num_matched_tokens == len(chain_tokens(chain))
        assert read_back([c.target], NAMESPACE, everything) == 0
    finally:
        cluster.restart(victim)  # rejoins as a replica: later tests get a whole cluster
        cluster.wait_healthy()


def test_a_hung_redis_degrades_sharing_never_the_sidecar(
    single_redis, key_prefix, start_sidecar
) -> None:
    process, port = single_redis
    config = shared_config(f"redis://127.0.0.1:{port}/0", key_prefix, cluster=False)
    a, b = start_sidecar("a", config), start_sidecar("b", config)
    chain = make_chain(8)
    with make_client(a) as client_a:
        assert all(client_a.put_segment(m, p) for m, p in chain)
    assert a.server.store.shared.wait_published(5.0)
    load = LoadRun(load_spec((a.target,), chain, num_clients=1)).start()
    time.sleep(0.5)
    process.send_signal(signal.SIGSTOP)
    seen: list[tuple[str, int, str]] = []
    gauges: list[float] = []
    pending: list[int] = []
    done_before = {op: len(load.stats[op].latencies_s) for op in ("get", "put")}
    try:
        until = time.monotonic() + 3.0
        while time.monotonic() < until:
            status, ready = readyz(a)
            seen.append((health_status(a), status, ready["shared_tier"]["state"]))
            gauges.append(metric(a, "kvsplice_shared_tier_degraded"))
            pending.append(a.server.store.shared.status().num_pending)
            time.sleep(0.2)
        done_during = {op: len(load.stats[op].latencies_s) - n for op, n in done_before.items()}
    finally:
        process.send_signal(signal.SIGCONT)
    time.sleep(1.0)
    load.stop()
    summary = load.summary()
    assert summary["get"]["failed_or_missed"] == 0 and summary["put"]["failed_or_missed"] == 0
    # gets and puts were answered while Redis hung, the puts acked with their sharing pending
    assert min(done_during.values()) >= 1 and max(pending) >= 1, (done_during, pending)
    assert {health for health, _, _ in seen} == {"SERVING"}
    assert {status for _, status, _ in seen} == {200}
    assert ("SERVING", 200, "degraded") in seen and 1.0 in gauges
    # what was acked during the hang is published once Redis answers again
    assert a.server.store.shared.wait_published(10.0)
    assert readyz(a)[1]["shared_tier"]["state"] == "connected"
    wait_for(lambda: read_back([b.target], NAMESPACE, load.written), lambda n: n == 0, 5.0)


def test_redis_unreachable_at_start_starts_degraded_and_shares_once_it_appears(
    tmp_path: Path, key_prefix, start_sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port_run(1)
    config = shared_config(f"valkey://127.0.0.1:{port}", key_prefix, cluster=False)
    with caplog.at_level("WARNING"):
        a = start_sidecar("a", config)
    assert len([r for r in caplog.records if "unreachable at start" in r.message]) == 1
    status, ready = readyz(a)
    assert status == 200 and ready["shared_tier"]["state"] == "degraded"
    chain = make_chain(4)
    with make_client(a) as client_a:
        assert all(client_a.put_segment(m, p) for m, p in chain)
        assert read_back([a.target], NAMESPACE, chain) == 0  # served locally meanwhile
    process = spawn_redis(port, tmp_path)
    try:
        wait_ping(port, 10.0)
        assert a.server.store.shared.wait_published(10.0)
        assert readyz(a)[1]["shared_tier"]["state"] == "connected"
        b = start_sidecar("b", config)
        assert read_back([b.target], NAMESPACE, chain) == 0
    finally:
        process.kill()
        process.wait(timeout=10)
