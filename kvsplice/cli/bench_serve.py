"""`kvsplice bench serve`: vLLM's own serving clients against two engines per KV-sharing setup.

Runs from the vLLM virtualenv (`make vllm`); imports are lazy so `--help` never loads
torch or vLLM. Options are written out here: the benchmark's config holds a nested
workload shape and paths the derived-flag helpers do not cover.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Annotated

import typer

from kvsplice.cli.common import (
    DEFAULT_MODEL_CACHE,
    LogLevel,
    LogLevelOpt,
    ModelCacheOpt,
    ModelOpt,
    console,
    fail,
    setup_logging,
)
from kvsplice.cli.worker import bench_app, model_config

SDIST_BENCHMARKS = Path("vllm-0.32.0-sdist/vllm-0.32.0/benchmarks")


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _default_benchmarks_dir() -> Path:
    """Where `scripts/fetch_vllm_tests.py benchmarks` unpacks them (KVSPLICE_CACHE)."""
    base = os.environ.get("KVSPLICE_CACHE") or "~/.cache/kvsplice"
    return Path(base).expanduser() / SDIST_BENCHMARKS


@bench_app.command("serve")
def bench_serve(
    json_path: Annotated[Path, typer.Option("--json", help="Write the results JSON here.")],
    workloads: Annotated[
        str, typer.Option(help="Comma-separated: prefix_repetition, multi_turn, random.")
    ] = "prefix_repetition,multi_turn,random",
    concurrency: Annotated[
        str, typer.Option(help="Comma-separated client concurrencies.")
    ] = "1,4,16",
    configs: Annotated[
        str, typer.Option(help="Comma-separated: recompute, local-apc, lmcache, kvsplice.")
    ] = "recompute,local-apc,lmcache,kvsplice",
    num_prompts: Annotated[
        int,
        typer.Option(
            min=4,
            help="Requests per run at concurrency <= 4, times concurrency // 4 above "
            "(multi_turn: turns, in whole conversations); a multiple of 4.",
        ),
    ] = 16,
    repeats: Annotated[
        int, typer.Option(min=1, max=20, help="Runs of each cell; >1 reports median and spread.")
    ] = 1,
    dtype: Annotated[str, typer.Option(help="Engine dtype: float32, bfloat16 or float16.")] = (
        "float32"
    ),
    threads: Annotated[
        str, typer.Option(help="CPU cores every engine is pinned to (VLLM_CPU_OMP_THREADS_BIND).")
    ] = "0-1",
    chunk_tokens: Annotated[
        int, typer.Option(min=16, help="Tokens per stored chunk, kvsplice's and LMCache's alike.")
    ] = 256,
    seed: Annotated[int, typer.Option(help="First run's seed (each run gets its own).")] = 0,
    vllm_benchmarks: Annotated[
        Path | None,
        typer.Option(
            help="vLLM 0.32.0's sdist benchmarks/ (default: where scripts/fetch_vllm_tests.py "
            "benchmarks unpacks them; make vllm does)."
        ),
    ] = None,
    work_dir: Annotated[
        Path, typer.Option(help="Engine logs, store data, each client's output.")
    ] = Path("results/bench-serve"),
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """vLLM's serve and multi-turn clients against two OpenAI servers (one router in front)
    per configuration (recompute, local-apc, LMCache, kvsplice) for prefix_repetition,
    ShareGPT multi_turn and random prompts: throughput, TTFT p50/p99, TPOT p99, hit tokens;
    writes --json."""
    setup_logging(log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll of every engine
    if importlib.util.find_spec("vllm") is None:
        fail("vLLM is not installed here: run it from .venv-vllm (make vllm)")
    from kvsplice.client.model.models import model_directory
    from kvsplice.eval.bench.serve.bench import run_bench
    from kvsplice.eval.bench.serve.config import ServeBenchConfig
    from kvsplice.eval.bench.serve.report import print_table

    try:
        config = ServeBenchConfig(
            model_dir=str(model_directory(model_config(model, model_cache))),
            out_json=json_path, work_dir=work_dir,
            benchmarks_dir=vllm_benchmarks or _default_benchmarks_dir(),
            configs=_names(configs), workloads=_names(workloads),
            concurrencies=tuple(int(c) for c in _names(concurrency)),
            num_prompts=num_prompts, repeats=repeats, dtype=dtype, threads=threads,
            chunk_tokens=chunk_tokens, seed=seed,
        )  # fmt: skip
        report = run_bench(config)
    except ValueError as error:
        fail(str(error))
    print_table(report, console())
