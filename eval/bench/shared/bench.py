"""The shared-tier bench: sidecar processes on a loopback Redis Cluster, faults injected.

    python -m kvsplice.eval.bench.shared --out results/shared_tier.json [--load-s 60]

Three scenarios, each with its own servers: `sharing` (two sidecars on a 3+3 cluster,
a master killed under load, a third sidecar started afterwards), `hang` (one Redis
SIGSTOPped 8 s under a reading and writing worker) and `load` (32 clients across two
sidecars). Sidecars run as `kvsplice serve` processes, as in a deployment. Owns the
scenarios and the report; the load loop is `load`'s.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsplice.eval.bench.shared.load import OPS, LoadRun, LoadSpec, OpStats, make_chain, read_back
from kvsplice.eval.bench.shared.local_cluster import (
    LocalCluster,
    free_port_run,
    spawn_redis,
    wait_ping,
)
from kvsplice.storeclient.client import StoreClient

logger = logging.getLogger(__name__)

NAMESPACE = "bench-shared"
FINGERPRINT = "kvfp1-" + "e" * 32
KVSPLICE = str(Path(sys.executable).with_name("kvsplice"))


class Sidecar:
    """A `kvsplice serve` process on loopback ports of its own."""

    def __init__(self, workdir: Path, name: str, redis_url: str, cluster: bool) -> None:
        port = free_port_run(2)
        self.target, self.admin = f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"
        command = [KVSPLICE, "serve", "--listen", self.target, "--admin-listen", self.admin]
        command += ["--lmdb-path", str(workdir / name), "--no-lmdb-sync", "--redis-url", redis_url]
        command += ["--log-level", "WARNING"]
        env = {**os.environ, "KVSPLICE_REDIS_CLUSTER": "1" if cluster else "0"}
        log = (workdir / f"{name}.log").open("w")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while self.health() != "SERVING":
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"sidecar {name} did not start (see {log.name})")
            time.sleep(0.2)

    def health(self) -> str:
        try:
            with grpc.insecure_channel(self.target) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                # types-grpcio-health-checking's HealthStub declares no methods
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)  # type: ignore[attr-defined]
        except grpc.RpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def readyz(self) -> dict:
        reply = httpx.get(f"http://{self.admin}/readyz", timeout=2.0)
        return {"http": reply.status_code, **reply.json()}

    def pending_writes(self) -> int:
        return int(self.readyz()["shared_tier"]["pending_writes"])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=30)


@contextmanager
def sidecars(workdir: Path, url: str, cluster: bool, names: list[str]) -> Iterator[list[Sidecar]]:
    started: list[Sidecar] = []
    try:
        for name in names:
            started.append(Sidecar(workdir, name, url, cluster))
        yield started
    finally:
        for sidecar in started:
            sidecar.stop()


def wait_published(sidecar: Sidecar, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sidecar.pending_writes() and time.monotonic() < deadline:
        time.sleep(0.1)


def chain_lookup(target: str, chain: list, timeout_s: float) -> tuple[float, float]:
    """(fraction of the chain's tokens found, seconds until all were) through `target`."""
    tokens = [t for meta, _ in chain for t in meta.token_ids]
    started = time.monotonic()
    with StoreClient(target, NAMESPACE) as client:
        while True:
            found = client.lookup_prefix(FINGERPRINT, tokens).num_matched_tokens
            if found == len(tokens) or time.monotonic() - started > timeout_s:
                return found / len(tokens), time.monotonic() - started
            time.sleep(0.01)


def scenario_sharing(workdir: Path) -> dict:
    chain = make_chain(NAMESPACE, FINGERPRINT, 32, 64, 64 * 1024, seed=1)
    cluster = LocalCluster(workdir / "cluster").start()
    try:
        with sidecars(workdir, cluster.url, True, ["a", "b"]) as (a, b):
            with StoreClient(a.target, NAMESPACE) as client:
                num_acked = sum(client.put_segment(m, p) for m, p in chain)
            fraction, visible_s = chain_lookup(b.target, chain, timeout_s=5.0)
            report: dict = {
                "chain": {"segments": len(chain), "acked": num_acked, "tokens_found_on_b": fraction,
                          "visible_on_b_s": round(visible_s, 3),
                          "not_identical_on_b": read_back([b.target], NAMESPACE, chain)},
            }  # fmt: skip
            spec = LoadSpec((a.target, b.target), NAMESPACE, FINGERPRINT, tuple(chain), 4)
            load = LoadRun(spec).start()
            time.sleep(2.0)
            victim = cluster.masters()[0]
            cluster.kill(victim)
            promoted_s = cluster.wait_promoted(victim)
            time.sleep(3.0)
            load.stop()
            for sidecar in (a, b):
                wait_published(sidecar)
            everything = chain + load.written
            time.sleep(0.5)
            report["failover"] = {
                "replica_promoted_after_s": round(promoted_s, 2),
                "ops": load.summary(),
                "not_identical_afterwards_on_b": read_back([b.target], NAMESPACE, everything),
                "segments_checked": len(everything),
            }
            with sidecars(workdir, cluster.url, True, ["c"]) as (c,):
                fraction_c, _ = chain_lookup(c.target, chain, timeout_s=5.0)
                report["third_sidecar"] = {
                    "tokens_found": fraction_c,
                    "not_identical": read_back([c.target], NAMESPACE, everything),
                    "segments_checked": len(everything),
                }
        return report
    finally:
        cluster.close()


def scenario_hang(workdir: Path, pause_s: float = 8.0) -> dict:
    port = free_port_run(1)
    redis = spawn_redis(port, workdir)
    wait_ping(port, 10.0)
    chain = make_chain(NAMESPACE, FINGERPRINT, 16, 64, 64 * 1024, seed=2)
    try:
        with sidecars(workdir, f"redis://127.0.0.1:{port}/0", False, ["h"]) as (sidecar,):
            with StoreClient(sidecar.target, NAMESPACE) as client:
                assert all(client.put_segment(m, p) for m, p in chain)
            wait_published(sidecar)
            spec = LoadSpec((sidecar.target,), NAMESPACE, FINGERPRINT, tuple(chain), 1)
            load = LoadRun(spec).start()
            time.sleep(2.0)
            redis.send_signal(signal.SIGSTOP)
            health, states = [], set()
            until = time.monotonic() + pause_s
            while time.monotonic() < until:
                health.append(sidecar.health())
                ready = sidecar.readyz()
                states.add((ready["http"], ready["shared_tier"]["state"]))
                time.sleep(0.2)
            redis.send_signal(signal.SIGCONT)
            time.sleep(2.0)
            load.stop()
            wait_published(sidecar)
            puts = load.stats["put"].latencies_s
            return {
                "paused_s": pause_s,
                "ops": load.summary(),
                "slowest_put_ms": round(1000 * max(puts), 1) if puts else None,
                "health_checks": {status: health.count(status) for status in set(health)},
                "readyz_seen": sorted(f"{http} {state}" for http, state in states),
                "pending_after_resume": sidecar.pending_writes(),
            }
    finally:
        redis.send_signal(signal.SIGCONT)
        redis.kill()
        redis.wait(timeout=10)


def _load_process(spec: LoadSpec, seed: int, duration_s: float) -> tuple[dict, float]:
    load = LoadRun(spec, seed=seed).start()
    time.sleep(duration_s)
    load.stop()
    stats = {op: (s.latencies_s, s.num_bad) for op, s in load.stats.items()}
    return stats, load.duration_s


def scenario_load(workdir: Path, num_clients: int, duration_s: float, num_procs: int) -> dict:
    chain = make_chain(NAMESPACE, FINGERPRINT, 32, 64, 64 * 1024, seed=3)
    cluster = LocalCluster(workdir / "load-cluster").start()
    try:
        with sidecars(workdir, cluster.url, True, ["la", "lb"]) as (a, b):
            with StoreClient(a.target, NAMESPACE) as client:
                assert all(client.put_segment(m, p) for m, p in chain)
            chain_lookup(b.target, chain, timeout_s=5.0)
            per_proc = num_clients // num_procs
            spec = LoadSpec((a.target, b.target), NAMESPACE, FINGERPRINT, tuple(chain), per_proc)
            # spawn, not fork: this process already runs gRPC threads (fork would deadlock)
            spawn = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(num_procs, mp_context=spawn) as pool:
                futures = [
                    pool.submit(_load_process, spec, seed, duration_s) for seed in range(num_procs)
                ]
                results = [future.result() for future in futures]
        merged = {op: OpStats() for op in OPS}
        for stats, _ in results:
            for op, (latencies, num_bad) in stats.items():
                merged[op].latencies_s.extend(latencies)
                merged[op].num_bad += num_bad
        wall_s = max(d for _, d in results)
        return {
            "clients": per_proc * num_procs,
            "duration_s": round(wall_s, 1),
            "ops": {op: merged[op].summary(wall_s) for op in OPS},
        }
    finally:
        cluster.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvsplice.eval.bench.shared", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("results/shared_tier.json"))
    parser.add_argument("--scenarios", default="sharing,hang,load")
    parser.add_argument("--load-clients", type=int, default=32)
    parser.add_argument("--load-s", type=float, default=60.0)
    parser.add_argument("--load-procs", type=int, default=4)
    parser.add_argument("--pause-s", type=float, default=8.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    report: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvsplice-bench-shared-") as tmp:
        workdir = Path(tmp)
        for name in args.scenarios.split(","):
            started = time.monotonic()
            if name == "sharing":
                report[name] = scenario_sharing(workdir)
            elif name == "hang":
                report[name] = scenario_hang(workdir, args.pause_s)
            elif name == "load":
                report[name] = scenario_load(
                    workdir, args.load_clients, args.load_s, args.load_procs
                )
            else:
                parser.error(f"unknown scenario {name!r}")
            report[name]["scenario_s"] = round(time.monotonic() - started, 1)
            print(json.dumps({name: report[name]}, indent=2), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
