"""`kvsplice bench vllm`: a 5-agent transcript pipeline on real vLLM engines, per KV-sharing setup.

Each configuration starts its engines once (two processes, agents alternating so
each agent's predecessor ran on the other engine; `local-apc` one engine with
vLLM's own prefix cache, the ceiling), runs the pipeline live (each agent's
prompt holds the earlier answers as generated) and records each agent's TTFT,
the prompt tokens loaded from outside the engine, whether the outputs equal
`recompute`'s, and the bytes stored per token. Threads are pinned alike.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvsplice.eval.bench.vllm_engine import Engine, EngineSpec, LmcacheServer, Sidecar, free_port
from kvsplice.eval.workloads.token_transcript import (
    PIPELINE_ROLES,
    SYSTEM_PROMPT,
    TEAM_CONVENTIONS,
    TokenTranscript,
)

logger = logging.getLogger(__name__)

CONFIGS = (
    "recompute", "example-connector", "lmcache", "kvsplice", "kvsplice-grpc",
    "kvsplice-restarted", "local-apc",
)  # fmt: skip
NAMESPACE = "bench-vllm"
SETTLE_S = 1.0  # after each call, for every configuration: background stores finish
LMCACHE_CHUNK = 128


@dataclass(frozen=True)
class VllmBenchConfig:
    model_dir: str
    out_json: Path
    work_dir: Path
    configs: tuple[str, ...] = CONFIGS
    answer_tokens: int = 128
    problem_index: int = 129  # HumanEval's longest problem: agent 5's prompt > 1,500 tokens
    threads: str = "0-1"
    # float32 by default: in bfloat16 a prompt prefilled in two parts (loaded prefix +
    # computed rest) rounds differently from one pass, so greedy outputs can part after
    # ~100 tokens for every KV-sharing setup alike (vLLM's own prefix cache included).
    dtype: str = "float32"

    def __post_init__(self) -> None:
        unknown = set(self.configs) - set(CONFIGS)
        if unknown or not self.configs:
            raise ValueError(f"configs {sorted(unknown)} not in {CONFIGS}")
        if self.configs[0] != "recompute":
            raise ValueError(
                "configs must start with 'recompute' (output_match compares against it)"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r} not float32, bfloat16 or float16")
        if not 16 <= self.answer_tokens <= 1024:
            raise ValueError(f"answer_tokens {self.answer_tokens} not in [16, 1024]")


@dataclass
class ConfigResult:
    name: str
    agent_ttft_s: list[float] = field(default_factory=list)
    output_match: float = 0.0
    agent_output_match: list[bool] = field(default_factory=list)
    external_hit_tokens: int = 0
    stored_bytes_per_token: float | None = None
    agent_cached_tokens: list[int] = field(default_factory=list)
    agent_prompt_tokens: list[int] = field(default_factory=list)
    load_avg_1m: float = 0.0
    outputs: list[tuple[int, ...]] = field(default_factory=list)


@dataclass
class _Setup:
    """A configuration's running engines and what it needs to report bytes and restarts."""

    engines: list[Engine]
    after_call: Callable[[], None] = lambda: None
    bytes_per_token: Callable[[], float | None] = lambda: None


def run_bench(config: VllmBenchConfig, task_text: str) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    transcript = TokenTranscript(tokenizer, f"{SYSTEM_PROMPT}\n\n{TEAM_CONVENTIONS}")
    results: list[ConfigResult] = []
    report: dict[str, Any] = {}
    for name in config.configs:
        logger.info("configuration %s: starting its engines", name)
        with _setup(name, config) as setup:
            results.append(_run_pipeline(name, setup, transcript, task_text, config))
        logger.info("configuration %s: agent TTFTs %s", name, results[-1].agent_ttft_s)
        report = _write(config, results)  # after each configuration: a cut-short run keeps its rows
    return report


def _write(config: VllmBenchConfig, results: list[ConfigResult]) -> dict[str, Any]:
    reference = next(r for r in results if r.name == "recompute")
    for result in results:
        result.agent_output_match = [
            a == b for a, b in zip(result.outputs, reference.outputs, strict=True)
        ]
        result.output_match = sum(result.agent_output_match) / len(reference.outputs)
    report = _report(config, results)
    config.out_json.parent.mkdir(parents=True, exist_ok=True)
    config.out_json.write_text(json.dumps(report, indent=2))
    return report


def _run_pipeline(
    name: str, setup: _Setup, transcript: TokenTranscript, task: str, config: VllmBenchConfig
) -> ConfigResult:
    result = ConfigResult(name)
    prompt: list[int] = []
    answer: tuple[int, ...] = ()
    for i, (_, instruction) in enumerate(PIPELINE_ROLES):
        prompt = (
            transcript.first_prompt(task, instruction) if i == 0
            else transcript.next_prompt(prompt, answer, instruction)
        )  # fmt: skip
        engine = setup.engines[i % len(setup.engines)]
        done = engine.complete(
            prompt, max_tokens=config.answer_tokens, min_tokens=config.answer_tokens
        )
        answer = done.token_ids
        result.agent_ttft_s.append(done.ttft_s)
        result.agent_cached_tokens.append(done.num_cached_tokens)
        result.agent_prompt_tokens.append(len(prompt))
        result.outputs.append(answer)
        time.sleep(SETTLE_S)
        setup.after_call()
    result.external_hit_tokens = sum(result.agent_cached_tokens) if name != "local-apc" else 0
    result.stored_bytes_per_token = setup.bytes_per_token()
    result.load_avg_1m = os.getloadavg()[0]
    return result


@contextmanager
def _setup(name: str, config: VllmBenchConfig) -> Iterator[_Setup]:
    logs = config.work_dir / "logs"
    data = config.work_dir / name
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    env = {"VLLM_CPU_OMP_THREADS_BIND": config.threads}
    stops: list[Callable[[], None]] = []
    try:
        setup = _services(name, config, data, logs, env, stops)
        with ThreadPoolExecutor(len(setup.engines)) as pool:
            list(pool.map(lambda engine: engine.wait_ready(), setup.engines))
        for engine in setup.engines:  # warm-up: shares no prefix with the pipeline
            engine.complete(list(range(1000, 1000 + 300)), max_tokens=4)
        yield setup
    finally:
        for stop in reversed(stops):
            stop()


def _services(
    name: str, config: VllmBenchConfig, data: Path, logs: Path, env: dict[str, str],
    stops: list[Callable[[], None]],
) -> _Setup:  # fmt: skip
    """Start what configuration `name` needs; every stop goes into `stops` first."""

    def engines(
        *transfer: dict[str, Any] | None, apc: bool = False, extra: tuple[str, ...] = ()
    ) -> list[Engine]:
        started = []
        for i, kv in enumerate(transfer):
            spec = EngineSpec(
                f"{name}-{i}",
                config.model_dir,
                free_port(),
                kv,
                apc,
                config.dtype,
                env=env,
                extra_args=extra,
            )
            engine = Engine(spec, logs).start()
            stops.append(engine.stop)
            started.append(engine)
        return started

    if name == "recompute":
        return _Setup(engines(None, None))
    if name == "local-apc":
        return _Setup(engines(None, apc=True))
    if name == "example-connector":
        kv = _transfer("ExampleConnector", None, {"shared_storage_path": str(data)})
        stored = lambda: _dir_bytes_per_token(data)  # noqa: E731
        return _Setup(engines(kv, kv), bytes_per_token=stored)
    if name == "lmcache":
        server = LmcacheServer(free_port(), free_port(), logs, env).start()
        stops.append(server.stop)
        kv = _transfer(
            "LMCacheMPConnector", "lmcache.integration.vllm.lmcache_mp_connector",
            {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": server.port},
        )  # fmt: skip
        hybrid_off = ("--disable-hybrid-kv-cache-manager",)
        return _Setup(engines(kv, kv, extra=hybrid_off), bytes_per_token=server.bytes_per_token)
    sidecar = Sidecar(data, free_port(), free_port(), logs).start()
    stops.append(sidecar.stop)
    extra = {"target": sidecar.target, "namespace": NAMESPACE}
    if name == "kvsplice-grpc":
        extra["same_host_reads"] = False
    kv = _transfer("KvspliceConnector", "kvsplice.integrations.vllm", extra)
    restart = sidecar.restart if name == "kvsplice-restarted" else (lambda: None)
    return _Setup(engines(kv, kv), after_call=lambda: _settle_then(sidecar, restart),
                  bytes_per_token=lambda: _sidecar_bytes_per_token(sidecar))  # fmt: skip


def _transfer(connector: str, module: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "kv_connector": connector, "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra,
    }  # fmt: skip
    if module is not None:
        config["kv_connector_module_path"] = module
    return config


def _settle_then(sidecar: Sidecar, then: Callable[[], object]) -> None:
    _wait_until_stored(sidecar)
    then()


def _wait_until_stored(sidecar: Sidecar, settle_s: float = 0.5, timeout_s: float = 30.0) -> None:
    last, since = -1, time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        count = sidecar.namespace_stats(NAMESPACE).get("num_segments", 0)
        if count != last:
            last, since = count, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            return
        time.sleep(0.1)


def _sidecar_bytes_per_token(sidecar: Sidecar) -> float | None:
    stats = sidecar.namespace_stats(NAMESPACE)
    segments = int(stats.get("num_segments", 0))
    return stats["stored_bytes"] / (segments * LMCACHE_CHUNK) if segments else None


def _dir_bytes_per_token(path: Path) -> float | None:
    """ExampleConnector keeps one folder per stored prompt, its whole-block tokens in each file."""
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    folders = [d for d in path.iterdir() if d.is_dir()]
    return None if not folders else total / max(1, _example_tokens(folders))


def _example_tokens(folders: list[Path]) -> int:
    import safetensors

    tokens = 0
    for folder in folders:
        first = next(folder.glob("*.safetensors"), None)
        if first is not None:
            with safetensors.safe_open(str(first), "pt") as f:
                tokens += int(f.get_slice("kv_cache").get_shape()[0])
    return tokens


def _report(config: VllmBenchConfig, results: list[ConfigResult]) -> dict[str, Any]:
    rows = []
    for r in results:
        row = asdict(r)
        row.pop("outputs")
        rows.append(row)
    return {
        "configs": rows,
        "model_dir": config.model_dir,
        "answer_tokens": config.answer_tokens,
        "humaneval_problem": config.problem_index,
        "threads_bind": config.threads,
        "dtype": config.dtype,
        "block_size": LMCACHE_CHUNK,
        "load_avg": list(os.getloadavg()),
        "num_cpus": os.cpu_count(),
    }


def print_report(report: dict[str, Any], console: Any) -> None:
    """The per-agent TTFT table and agent 5's ratios against recompute and local-apc."""
    from kvsplice.eval.report.tables import figures_table

    rows = {row["name"]: row for row in report["configs"]}
    base = rows["recompute"]["agent_ttft_s"][-1]
    apc = rows["local-apc"]["agent_ttft_s"][-1] if "local-apc" in rows else None
    columns = ("config", "a1", "a2", "a3", "a4", "a5", "vs rec", "vs apc", "hit tok",
               "match", "B/tok")  # fmt: skip
    title = "bench vllm: TTFT per agent (s); agent 5 vs recompute / vs local-apc"
    table = figures_table(columns, ("config",), title=title)
    for name, row in rows.items():
        ttft = row["agent_ttft_s"]
        bpt = row["stored_bytes_per_token"]
        table.add_row(
            name, *(f"{t:.3f}" for t in ttft), f"{base / ttft[-1]:.2f}x",
            "" if apc is None else f"{ttft[-1] / apc:.2f}x", str(row["external_hit_tokens"]),
            f"{row['output_match']:.2f}", "" if bpt is None else f"{bpt:.0f}",
        )  # fmt: skip
    console.print(table)
    prompts = rows["recompute"]["agent_prompt_tokens"]
    console.print(
        f"prompt tokens per agent {prompts}; load average {report['load_avg']}; "
        f"threads pinned to {report['threads_bind']}; dtype {report.get('dtype', 'bfloat16')}"
    )
