"""`kvsplice bench serve`: vLLM's own clients against two OpenAI servers behind one router.

Per configuration it starts two engines once (LMCache and kvsplice: both engines to one
store) and a router in front, then runs each workload at each concurrency (`repeats`
times) on prompts no other run shares, the engines' prefix caches emptied before each
run; a row per run: the client's throughput and latency, the hit tokens (`HIT_TOKENS`
in report.py) from the engines' counters, the load average before and after.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from kvsplice.eval.bench.process_cpu import cpu_s_per_request, groups_cpu_s
from kvsplice.eval.bench.serve.config import ServeBenchConfig
from kvsplice.eval.bench.serve.report import (
    HIT_TOKENS,
    STORE,
    cpu_columns,
    fold_repeats,
    hit_token_deltas,
    run_row,
)
from kvsplice.eval.bench.serve.router import STATS_PATH
from kvsplice.eval.bench.serve.sharegpt import disjoint_sets, sample_conversations
from kvsplice.eval.bench.serve.workloads import (
    ClientRun,
    client_command,
    num_conversations,
    read_metrics,
)
from kvsplice.eval.bench.vllm.engine import (
    Child,
    Engine,
    EngineError,
    EngineSpec,
    LmcacheServer,
    Sidecar,
    free_port,
    wait_all_ready,
)
from kvsplice.eval.bench.vllm.kv_transfer import (
    LMCACHE_ENGINE_ARGS,
    kvsplice_transfer,
    lmcache_transfer,
)

logger = logging.getLogger(__name__)

NAMESPACE = "bench-serve"
SETTLE_S = 1.0  # after each run: counters published, background stores done
CLIENT_BASE_TIMEOUT_S = 300.0
CLIENT_TIMEOUT_PER_REQUEST_S = 60.0


@dataclass(frozen=True)
class PlannedRun:
    """One run's workload, concurrency and repeat; the same prompts for every configuration."""

    workload: str
    concurrency: int
    repeat: int
    seed: int
    num_requests: int
    conversations: tuple[dict[str, Any], ...] = ()  # multi_turn only

    @property
    def name(self) -> str:
        return f"{self.workload}-c{self.concurrency}-r{self.repeat}"


@dataclass
class _Serving:
    engines: list[Engine]
    router_url: str
    groups: dict[str, int]  # process group of each engine and of the store, by name


def plan_runs(config: ServeBenchConfig) -> list[PlannedRun]:
    """Every run in order (repeat, workload, concurrency), each with its own seed."""
    keys = [(r, w, c) for r in range(config.repeats) for w in config.workloads
            for c in config.concurrencies]  # fmt: skip
    return [
        PlannedRun(w, c, r, config.seed + i, config.num_requests(c))
        for i, (r, w, c) in enumerate(keys)
    ]


def with_conversations(config: ServeBenchConfig, runs: list[PlannedRun]) -> list[PlannedRun]:
    """multi_turn runs given disjoint ShareGPT conversations (one sample for them all)."""
    turns = [r for r in runs if r.workload == "multi_turn"]
    if not turns:
        return runs
    sizes = [num_conversations(r.num_requests, r.concurrency, config.shape) for r in turns]
    sample = sample_conversations(
        config.benchmarks_dir, config.work_dir / "sharegpt", num_conversations=sum(sizes),
        num_messages=2 * config.shape.user_turns,
        max_content_chars=config.shape.max_content_chars, seed=config.seed,
    )  # fmt: skip
    given = dict(zip((r.name for r in turns), disjoint_sets(sample, sizes), strict=True))
    return [replace(r, conversations=tuple(given[r.name])) if r.name in given else r for r in runs]


def run_bench(config: ServeBenchConfig) -> dict[str, Any]:
    started = time.time()
    runs = with_conversations(config, plan_runs(config))  # before any engine: fails early
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    for name in config.configs:
        logger.info("configuration %s: starting two engines and the router", name)
        with _serving(name, config) as serving:
            for run in runs:
                rows.append(_measure(name, run, serving, config))
                report = write_report(config, rows, started)  # a cut-short run keeps its rows
    return report


def _measure(
    name: str, run: PlannedRun, serving: _Serving, config: ServeBenchConfig
) -> dict[str, Any]:
    out_dir = config.work_dir / "runs" / name / run.name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    client = _client_run(run, serving.router_url, config, out_dir)
    for engine in serving.engines:
        engine.reset_prefix_cache()
    before = [engine.counters(split_by="source") for engine in serving.engines]
    sent_before, failed_before = _routed(serving.router_url)
    load_before = os.getloadavg()[0]
    cpu_before = groups_cpu_s(serving.groups)
    logger.info("%s: %s (%d %s)", name, run.name, len(run.conversations) or run.num_requests,
                "conversations" if run.conversations else "requests")  # fmt: skip
    _run_client(client, config, out_dir)
    cpu = cpu_s_per_request(cpu_before, groups_cpu_s(serving.groups), run.num_requests)
    time.sleep(SETTLE_S)
    after = [engine.counters(split_by="source") for engine in serving.engines]
    metrics = read_metrics(client)
    sent_after, failed_after = _routed(serving.router_url)
    if run.workload == "multi_turn":  # its failed turns leave no stats: the router saw them
        metrics = replace(metrics, num_failed=sum(_delta(failed_after, failed_before)))
    identity = {"workload": run.workload, "concurrency": run.concurrency, "config": name,
                "repeat": run.repeat}  # fmt: skip
    extra = {"requests_per_engine": _delta(sent_after, sent_before), "seed": run.seed,
             "load_avg_1m_before": load_before, "load_avg_1m_after": os.getloadavg()[0],
             "cpu_s_per_request": cpu, **cpu_columns(cpu)}  # fmt: skip
    row = run_row(identity, metrics, hit_token_deltas(before, after), extra)
    logger.info("%s: %s: %.2f req/s, TTFT p50 %.3f s, %d hit tokens", name, run.name,
                row["requests_per_s"], row["ttft_p50_s"], row["hit_tokens"])  # fmt: skip
    return row


def _client_run(run: PlannedRun, url: str, config: ServeBenchConfig, out_dir: Path) -> ClientRun:
    conversations = None
    if run.workload == "multi_turn":
        conversations = out_dir / "conversations.json"
        conversations.write_text(json.dumps(list(run.conversations)))
    return ClientRun(run.workload, run.concurrency, run.num_requests, run.seed, url,
                     config.model_dir, out_dir, conversations)  # fmt: skip


def _run_client(client: ClientRun, config: ServeBenchConfig, out_dir: Path) -> None:
    """Run a client to its end; past `client_timeout_s`, kill it and its processes."""
    command = client_command(client, config.shape, config.benchmarks_dir)
    log = out_dir / "client.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        returncode: int | None = None
        try:
            returncode = process.wait(client_timeout_s(client.num_requests))
        except subprocess.TimeoutExpired:
            pass
        finally:  # timed out or interrupted: the multi-turn client's own processes too
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    if returncode != 0 or not client.result_path.is_file():
        tail = log.read_text(errors="replace")[-3000:]
        outcome = "timed out" if returncode is None else f"exit status {returncode}"
        raise EngineError(f"the {client.workload} client failed ({outcome}); "
                          f"the end of {log}:\n{tail}")  # fmt: skip


def client_timeout_s(num_requests: int) -> float:
    """Generous for a loaded 2-core host; a client whose process died waits forever."""
    return CLIENT_BASE_TIMEOUT_S + CLIENT_TIMEOUT_PER_REQUEST_S * num_requests


def _routed(router_url: str) -> tuple[list[int], list[int]]:
    """Generation requests the router sent each engine, and those answered with an error."""
    stats = httpx.get(router_url + STATS_PATH, timeout=10.0).json()
    return stats["requests"], stats["failed"]


def _delta(after: list[int], before: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before, strict=True)]


@contextmanager
def _serving(name: str, config: ServeBenchConfig) -> Iterator[_Serving]:
    logs = config.work_dir / "logs" / name
    data = config.work_dir / "stores" / name
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    stops: list[Callable[[], None]] = []
    groups: dict[str, int] = {}
    try:
        engines = _engines(name, config, data, logs, stops, groups)
        wait_all_ready(engines)
        for engine in engines:  # warm-up: shares no prefix with any run
            engine.complete(list(range(1000, 1300)), max_tokens=4)
        yield _Serving(engines, _start_router(engines, logs, stops), groups)
    finally:
        for stop in reversed(stops):
            stop()


def _engines(
    name: str, config: ServeBenchConfig, data: Path, logs: Path,
    stops: list[Callable[[], None]], groups: dict[str, int],
) -> list[Engine]:  # fmt: skip
    """Start the store configuration `name` needs, then its two engines (not yet ready);
    each one's process group in `groups` (the store as STORE)."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": config.threads, "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "2"}  # fmt: skip
    kv: dict[str, Any] | None = None
    extra: tuple[str, ...] = ()
    if name == "lmcache":
        server = LmcacheServer(free_port(), free_port(), logs, env, config.chunk_tokens)
        stops.append(server.stop)
        kv = lmcache_transfer(server.start().port, save_decode=True)
        extra = LMCACHE_ENGINE_ARGS
        groups[STORE] = server.process.pid  # type: ignore[union-attr]
    elif name == "kvsplice":
        sidecar = Sidecar(data, free_port(), free_port(), logs)
        stops.append(sidecar.stop)
        kv = kvsplice_transfer(sidecar.start().target, NAMESPACE,
                               chunk_tokens=config.chunk_tokens, save_decode=True)  # fmt: skip
        groups[STORE] = sidecar.process.pid  # type: ignore[union-attr]
    engines = []
    for i in range(2):
        spec = EngineSpec(
            f"{name}-{i}", config.model_dir, free_port(), kv, name != "recompute",
            config.dtype, env=env, extra_args=extra, log_stats=True,
        )  # fmt: skip
        engine = Engine(spec, logs)
        stops.append(engine.stop)
        engines.append(engine.start())
        groups[spec.name] = engine.process.pid  # type: ignore[union-attr]
    return engines


def _start_router(engines: list[Engine], logs: Path, stops: list[Callable[[], None]]) -> str:
    port = free_port()
    backends = [arg for engine in engines for arg in ("--backend", engine.url)]
    command = [sys.executable, "-m", "kvsplice.eval.bench.serve.router", "--port", str(port),
               *backends]  # fmt: skip
    router = Child(f"router-{port}", command, {}, logs)
    stops.append(router.stop)
    router.spawn()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        router.check_alive()
        try:
            if httpx.get(url + STATS_PATH, timeout=2.0).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise EngineError(f"the router did not answer in 60 s (log {router.log_path})")


def write_report(
    config: ServeBenchConfig, rows: list[dict[str, Any]], started: float
) -> dict[str, Any]:
    report = {
        "runs": fold_repeats(rows),
        "hit_tokens_definition": HIT_TOKENS,
        "model_dir": config.model_dir,
        "dtype": config.dtype,
        "threads_bind": config.threads,
        "chunk_tokens": config.chunk_tokens,
        "num_prompts": config.num_prompts,
        "repeats": config.repeats,
        "seed": config.seed,
        "workload_shape": asdict(config.shape),
        "setup": {
            "engines": "two vLLM OpenAI servers per configuration, one router in front "
            "(a chat turn goes to the other engine than its conversation's last turn; any "
            "other request round robin); prefix caching off for recompute, on otherwise",
            "lmcache": "LMCacheMPConnector, one server in its shared-memory mode; "
            "chunk_tokens-token chunks; generated tokens' K/V stored (save_decode_cache)",
            "kvsplice": "KvspliceConnector, one sidecar (LMDB); chunk_tokens-token chunks; "
            "generated tokens' K/V stored (save_decode)",
            "clients": "vllm.benchmarks.serve 0.32.0 (prefix_repetition, random); the "
            "sdist's benchmarks/multi_turn/benchmark_serving_multi_turn.py (multi_turn, "
            "ShareGPT sampled by its convert_sharegpt_to_openai.py)",
        },
        "cpu_accounting": "store_cpu_s_per_request / engine_cpu_s_per_request: user + system "
        "CPU seconds of the store's and both engines' process groups (each server and what it "
        "forked, /proc) over the client's run, divided by its requests",
        "num_cpus": os.cpu_count(),
        "load_avg": list(os.getloadavg()),
        "duration_s": time.time() - started,
    }
    if config.repeats > 1:
        report["repeat_runs"] = rows
    config.out_json.parent.mkdir(parents=True, exist_ok=True)
    config.out_json.write_text(json.dumps(report, indent=2))
    return report
