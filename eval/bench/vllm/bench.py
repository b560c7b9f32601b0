"""`kvsplice bench vllm`: a 5-agent pipeline on real vLLM engines, per KV-sharing setup.

Each configuration starts its engines once (two processes, agents alternating so
each agent's predecessor ran on the other engine; `local-apc` one engine with
vLLM's own prefix cache, the ceiling), runs the pipeline live (each agent's
prompt holds the earlier answers as generated) `repeats` times and records each
agent's TTFT (median and spread), the prompt tokens loaded from outside the
engine, whether the outputs equal `recompute`'s, and the bytes stored per token.
Connector configurations run with vLLM's prefix cache on (as deployed) and off;
kvsplice and LMCache store decode-written K/V alike (both or neither) in chunks of
the same length. Threads are pinned alike; the load average is recorded per run.
Each repeat sends its own `cache_salt`: vLLM's prefix cache, kvsplice and LMCache keep
repeats apart (a repeat of the same problem would otherwise find the earlier one's
answers by content). Layouts: `transcript` (each prompt extends the last: exact reuse
reaches it) and `persona-first` (each agent under its own system prompt, the shared
context and earlier answers quoted after it: exact reuse stops at the persona). In
persona-first each repeat of every configuration first runs the pipeline once,
un-measured, on another problem, so each persona has been seen (a pipeline that has run
before); `kvsplice-gated` engines admit
approximate reuse (a policy admitting naive, written for the served model) and every
request asks for it; how many prompt tokens came from outside the engine and whether the
outputs equal recompute's are then the figures that matter.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvsplice.common.reuse_modes import ANCHOR, DENSE, EXACT, NAIVE
from kvsplice.eval.bench.vllm.config import (
    APPROXIMATE,
    CONTROLS,
    REQUESTED_REUSE,
    VllmBenchConfig,
)
from kvsplice.eval.bench.vllm.engine import Engine, EngineSpec, LmcacheServer, Sidecar, free_port
from kvsplice.eval.bench.vllm.graded import GradedRun, grade_run, summarize
from kvsplice.eval.bench.vllm.kv_transfer import (
    LMCACHE_ENGINE_ARGS,
    kvsplice_transfer,
    lmcache_transfer,
    transfer_config,
)
from kvsplice.eval.workloads.graded_pipelines import PIPELINES
from kvsplice.eval.workloads.token_transcript import PersonaTranscript, TokenTranscript
from kvsplice.eval.workloads.workload import Problem
from kvsplice.integrations.vllm.connector_config import salted_namespace

logger = logging.getLogger(__name__)

NAMESPACE = "bench-vllm"
SETTLE_S = 1.0  # after each call, for every configuration: background stores finish
GRADED_SALT = "bench-graded"  # every graded run of a configuration (after one warm-up)


@dataclass
class ConfigResult:
    name: str
    prefix_caching: bool = False
    agent_ttft_s: list[float] = field(default_factory=list)  # per agent, median over repeats
    agent_ttft_min_s: list[float] = field(default_factory=list)
    agent_ttft_max_s: list[float] = field(default_factory=list)
    agent_ttft_runs_s: list[list[float]] = field(default_factory=list)  # per repeat, per agent
    load_avg_runs: list[float] = field(default_factory=list)  # 1-minute load after each repeat
    output_match: float = 0.0
    agent_output_match: list[bool] = field(default_factory=list)
    external_hit_tokens: int = 0
    stored_bytes_per_token: float | None = None
    agent_cached_tokens: list[int] = field(default_factory=list)
    agent_prompt_tokens: list[int] = field(default_factory=list)
    load_avg_1m: float = 0.0
    outputs: list[tuple[int, ...]] = field(default_factory=list)  # every repeat's agents, in order
    graded_runs: list[GradedRun] = field(default_factory=list)  # `--problems`, in their order
    graded: dict[str, Any] | None = None  # their summary against recompute's (`graded`)

    @property
    def label(self) -> str:
        connector = self.name not in ("recompute", "local-apc")
        return (
            f"{self.name} (apc {'on' if self.prefix_caching else 'off'})"
            if connector
            else self.name
        )


@dataclass
class _Setup:
    """A configuration's running engines and what it needs to report bytes and restarts."""

    engines: list[Engine]
    after_call: Callable[[], None] = lambda: None
    bytes_per_token: Callable[[], float | None] = lambda: None
    kv_transfer_params: dict[str, Any] | None = None  # sent with every request


def run_bench(
    config: VllmBenchConfig, task_text: str, warm_up_task: str = "",
    graded: Sequence[Problem] = (),
) -> dict[str, Any]:  # fmt: skip
    """Every configuration's timed repeats on `task_text`, then its graded runs of `graded`
    (`config.problems`' problems; `warm_up_task` must be none of them)."""
    from transformers import AutoTokenizer

    config_started_at(config)  # the run's start, in every report it writes
    tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
    # NOTE: one transcript and one cache salt per repeat: a repeat never hits what an
    # earlier one stored, by chain or by content
    transcripts = [_transcript(config, tokenizer, f"Run {r + 1}.") for r in range(config.repeats)]
    results: list[ConfigResult] = []
    report: dict[str, Any] = {}
    for name, apc in config.runs():
        result = ConfigResult(name, apc)
        logger.info("configuration %s: starting its engines", result.label)
        with _setup(name, apc, config) as setup:
            for r, transcript in enumerate(transcripts):
                salt = repeat_salt(r)
                if config.layout == "persona-first":
                    warm = _transcript(config, tokenizer, "Run 0.")
                    unmeasured = ConfigResult(name, apc)
                    _run_pipeline(unmeasured, setup, warm, warm_up_task or task_text, config, salt)
                _run_pipeline(result, setup, transcript, task_text, config, salt)
            if graded:
                warm_up = warm_up_task or task_text
                result.graded_runs = _graded_runs(setup, tokenizer, graded, warm_up, config)
        _summarize(result)
        results.append(result)
        logger.info("configuration %s: agent TTFTs %s", result.label, result.agent_ttft_s)
        report = _write(config, results)  # after each configuration: a cut-short run keeps its rows
    return report


def repeat_salt(repeat: int) -> str:
    """The `cache_salt` every request of repeat `repeat` (from 0) carries."""
    return f"bench-repeat-{repeat + 1}"


def _transcript(
    config: VllmBenchConfig, tokenizer: Any, label: str
) -> TokenTranscript | PersonaTranscript:
    """The pipeline's prompts in `config.layout`, `label` (the run) in its standing
    instructions: after them persona-first, before them in a transcript."""
    pipeline = PIPELINES[config.workload]
    if config.layout == "persona-first":
        return PersonaTranscript(tokenizer, f"{pipeline.context}\n\n{label}", pipeline.personas)
    return TokenTranscript(tokenizer, f"{label} {pipeline.system}\n\n{pipeline.context}")


def _graded_runs(
    setup: _Setup, tokenizer: Any, problems: Sequence[Problem], warm_up_task: str,
    config: VllmBenchConfig,
) -> list[GradedRun]:  # fmt: skip
    """One pipeline per problem, all under one cache salt after one un-measured warm-up (as a
    deployment that has run before), answers ending at the end of turn; each graded. Up to
    `config.concurrency` problems' pipelines run at once; the runs come back in order."""
    pipeline = PIPELINES[config.workload]
    transcript = _transcript(config, tokenizer, "Graded runs.")
    scratch = ConfigResult("graded")
    _run_pipeline(scratch, setup, transcript, warm_up_task, config, GRADED_SALT, fixed=False)

    def graded(problem: Problem) -> GradedRun:
        own = ConfigResult("graded")
        _run_pipeline(own, setup, transcript, problem.question, config, GRADED_SALT, fixed=False)
        texts = [str(tokenizer.decode(list(o), skip_special_tokens=True)) for o in own.outputs]
        run = grade_run(pipeline, problem, texts, own.outputs, config.answer_tokens)
        run = replace(run, cached_tokens=tuple(own.agent_cached_tokens),
                      prompt_tokens=tuple(own.agent_prompt_tokens),
                      ttft_s=tuple(own.agent_ttft_runs_s[-1]))  # fmt: skip
        logger.info("graded %s: %s", problem.problem_id, run.right)
        return run

    with ThreadPoolExecutor(config.concurrency) as pool:
        return list(pool.map(graded, problems))


def _summarize(result: ConfigResult) -> None:
    if not result.agent_ttft_runs_s:  # graded runs only
        result.load_avg_1m = os.getloadavg()[0]
        return
    per_agent = list(zip(*result.agent_ttft_runs_s, strict=True))
    result.agent_ttft_s = [statistics.median(ts) for ts in per_agent]
    result.agent_ttft_min_s = [min(ts) for ts in per_agent]
    result.agent_ttft_max_s = [max(ts) for ts in per_agent]
    result.load_avg_1m = max(result.load_avg_runs)


def _write(config: VllmBenchConfig, results: list[ConfigResult]) -> dict[str, Any]:
    reference = next(r for r in results if r.name == "recompute")
    for result in results:
        result.agent_output_match = [
            a == b for a, b in zip(result.outputs, reference.outputs, strict=True)
        ]
        result.output_match = sum(result.agent_output_match) / max(1, len(reference.outputs))
        if result.graded_runs:
            result.graded = summarize(result.graded_runs, reference.graded_runs)
    report = _report(config, results)
    assert config.out_json is not None  # checked by the config
    config.out_json.parent.mkdir(parents=True, exist_ok=True)
    config.out_json.write_text(json.dumps(report, indent=2))
    return report


def _run_pipeline(
    result: ConfigResult, setup: _Setup, transcript: TokenTranscript | PersonaTranscript,
    task: str, config: VllmBenchConfig, cache_salt: str, fixed: bool = True,
) -> None:  # fmt: skip
    """One run of the pipeline, every request salted with `cache_salt`, appended to `result`;
    `fixed`: every answer exactly `answer_tokens` long (timed runs), else up to it."""
    prompt: list[int] = []
    ttfts, cached, prompts = [], [], []
    answer: tuple[int, ...] = ()
    answers: list[tuple[str, tuple[int, ...]]] = []
    for i, (role, instruction) in enumerate(PIPELINES[config.workload].instructions):
        if isinstance(transcript, PersonaTranscript):
            prompt = transcript.prompt(role, task, answers, instruction)
        elif i == 0:
            prompt = transcript.first_prompt(task, instruction)
        else:
            prompt = transcript.next_prompt(prompt, answer, instruction)
        engine = setup.engines[i % len(setup.engines)]
        done = engine.complete(
            prompt, max_tokens=config.answer_tokens,
            min_tokens=config.answer_tokens if fixed else 0,
            cache_salt=cache_salt, kv_transfer_params=setup.kv_transfer_params,
        )  # fmt: skip
        answer = done.token_ids
        answers.append((role, answer))
        ttfts.append(done.ttft_s)
        cached.append(done.num_cached_tokens)
        prompts.append(len(prompt))
        result.outputs.append(answer)
        time.sleep(SETTLE_S)
        setup.after_call()
    result.agent_ttft_runs_s.append(ttfts)
    result.agent_cached_tokens, result.agent_prompt_tokens = cached, prompts  # the last run's
    # NOTE: with prefix caching on, vLLM counts its own hits in cached tokens too
    result.external_hit_tokens = sum(cached) if result.name != "local-apc" else 0
    if fixed:  # timed runs report it; a graded run's figures are only its answers
        result.stored_bytes_per_token = setup.bytes_per_token()
    result.load_avg_runs.append(os.getloadavg()[0])


@contextmanager
def _setup(name: str, apc: bool, config: VllmBenchConfig) -> Iterator[_Setup]:
    logs = config.work_dir / "logs"
    data = config.work_dir / f"{name}-apc-{'on' if apc else 'off'}"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    env = {"VLLM_CPU_OMP_THREADS_BIND": config.threads}
    stops: list[Callable[[], None]] = []
    try:
        setup = _services(name, apc, config, data, logs, env, stops)
        with ThreadPoolExecutor(len(setup.engines)) as pool:
            list(pool.map(lambda engine: engine.wait_ready(), setup.engines))
        for engine in setup.engines:  # warm-up: shares no prefix with the pipeline
            engine.complete(list(range(1000, 1000 + 300)), max_tokens=4)
        yield setup
    finally:
        for stop in reversed(stops):
            stop()


def _services(
    name: str, apc: bool, config: VllmBenchConfig, data: Path, logs: Path,
    env: dict[str, str], stops: list[Callable[[], None]],
) -> _Setup:  # fmt: skip
    """Start what configuration `name` needs (vLLM's prefix cache on when `apc`); every
    stop goes into `stops` first."""

    def engines(*transfer: dict[str, Any] | None, extra: tuple[str, ...] = ()) -> list[Engine]:
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
        return _Setup(engines(None))
    if name == "example-connector":
        kv = transfer_config("ExampleConnector", None, {"shared_storage_path": str(data)})
        stored = lambda: _dir_bytes_per_token(data)  # noqa: E731
        return _Setup(engines(kv, kv), bytes_per_token=stored)
    if name == "lmcache":
        server = LmcacheServer(
            free_port(), free_port(), logs, env, chunk_size=config.chunk_tokens
        ).start()
        stops.append(server.stop)
        kv = lmcache_transfer(server.port, save_decode=config.save_decode)
        return _Setup(
            engines(kv, kv, extra=LMCACHE_ENGINE_ARGS),
            bytes_per_token=lambda: server.bytes_per_token(config.chunk_tokens),
        )
    sidecar = Sidecar(data, free_port(), free_port(), logs).start()
    stops.append(sidecar.stop)
    extra: dict[str, Any] = {
        "chunk_tokens": config.chunk_tokens, "save_decode": config.save_decode,
        "load_async": config.load_async, "save_tails": config.save_tails,
    }  # fmt: skip
    if name == "kvsplice-grpc":
        extra["same_host_reads"] = False
    if name in APPROXIMATE:
        extra["reuse_policy"] = str(
            config.reuse_policy
            or write_naive_policy(config.model_dir, config.dtype, data / "naive-policy.json")
        )
    if name in CONTROLS:
        extra["negative_control"] = CONTROLS[name]
    kv = kvsplice_transfer(sidecar.target, NAMESPACE, **extra)
    restart = sidecar.restart if name == "kvsplice-restarted" else (lambda: None)
    salts = [repeat_salt(r) for r in range(config.repeats)] + (
        [GRADED_SALT] * bool(config.problems)
    )
    namespaces = [salted_namespace(NAMESPACE, salt) for salt in salts]
    return _Setup(engines(kv, kv), after_call=lambda: _settle_then(sidecar, namespaces, restart),
                  bytes_per_token=lambda: _sidecar_bytes_per_token(sidecar, namespaces),
                  kv_transfer_params=_opt_in(name))  # fmt: skip


def _opt_in(name: str) -> dict[str, Any] | None:
    """The `kv_transfer_params` every request of config `name` carries (None: no opt-in)."""
    reuse = REQUESTED_REUSE.get(name)
    return None if reuse is None else {"kvsplice": {"reuse": reuse}}


def write_naive_policy(model_dir: str, dtype: str, path: Path) -> Path:
    """An admission policy admitting `naive`, then `anchor`, for the model an engine serves
    from `model_dir` in `dtype`, so that requests asking for approximate reuse get it (what
    kvsplice-gated, naive first, and kvsplice-anchor measure without --reuse-policy; a
    deployment admits a mode only where the yardstick showed it holds: `bench vllm-graded
    --admit`)."""
    from kvsplice.client.modes.admission import AdmissionPolicy, save_policy

    modes = (DENSE, EXACT, NAIVE, ANCHOR)
    save_policy(AdmissionPolicy(_served(model_dir, dtype), modes), path)
    return path


def _settle_then(sidecar: Sidecar, namespaces: list[str], then: Callable[[], object]) -> None:
    _wait_until_stored(sidecar, namespaces)
    then()


def _wait_until_stored(
    sidecar: Sidecar, namespaces: list[str], settle_s: float = 0.5, timeout_s: float = 30.0
) -> None:
    last, since = -1, time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        count = sum(sidecar.namespace_stats(ns).get("num_segments", 0) for ns in namespaces)
        if count != last:
            last, since = count, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            return
        time.sleep(0.1)


def _sidecar_bytes_per_token(sidecar: Sidecar, namespaces: list[str]) -> float | None:
    """Payload bytes per stored token (chunks and half-chunk tails alike)."""
    segments = [s for ns in namespaces for s in sidecar.segments(ns)]
    num_tokens = sum(s["num_tokens"] for s in segments)
    return sum(s["payload_nbytes"] for s in segments) / num_tokens if num_tokens else None


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
        row.pop("graded_runs")
        row["label"] = r.label
        rows.append(row)
    return {
        "configs": rows,
        "model_dir": config.model_dir,
        "answer_tokens": config.answer_tokens,
        "humaneval_problem": config.problem_index,
        "workload": config.workload,
        "started_at": config_started_at(config),
        "graded_problems": list(config.problems),
        "graded_concurrency": config.concurrency,
        "served_fingerprint": _served(config.model_dir, config.dtype) if config.model_dir else None,
        "reuse_policy": str(config.reuse_policy)
        if config.reuse_policy
        else "written by the bench for kvsplice-gated, kvsplice-anchor and the controls: admits naive, then anchor",
        "threads_bind": config.threads,
        "dtype": config.dtype,
        "layout": config.layout,
        "chunk_tokens": config.chunk_tokens,
        "repeats": config.repeats,
        "decode_kv_stored": config.save_decode,
        "kvsplice_load_async": config.load_async,
        "kvsplice_save_tails": config.save_tails,
        "lmcache": {
            "transfer": "engine-driven through shared memory (server --shm-name)",
            "chunk_size": config.chunk_tokens,
            "save_decode_cache": config.save_decode,
            "eager_prefetch": True,
            "stores": "whole chunks only (its multi-process mode)",
            "hybrid_kv_cache_manager": "disabled (its connector requires it)",
        },
        "load_avg": list(os.getloadavg()),
        "num_cpus": os.cpu_count(),
    }


@functools.cache
def config_started_at(config: VllmBenchConfig) -> str:
    """When this run of the bench started (UTC, ISO 8601): the yardstick checks its rule was
    committed before it."""
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat(timespec="seconds")


@functools.cache
def _served(model_dir: str, dtype: str) -> str:
    """What the engines store K/V under (what an admission policy for them names), computed
    once per run: the policy the bench writes and every report written name it."""
    from kvsplice.eval.bench.vllm.admission import served_fingerprint

    return served_fingerprint(model_dir, dtype)
