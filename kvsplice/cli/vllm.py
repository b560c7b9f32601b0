"""`kvsplice model-dir` and `kvsplice bench vllm`: the model an engine serves, and the engine benchmark.

`bench vllm` runs from the vLLM virtualenv (`make vllm`); imports are lazy so `--help`
never loads torch or vLLM.
"""

from __future__ import annotations

import importlib.util
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

CONFIGS_HELP = (
    "Comma-separated configurations (default all): recompute, example-connector, lmcache, "
    "kvsplice, kvsplice-grpc, kvsplice-restarted, local-apc. recompute is always needed."
)


def model_dir(
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    log_level: LogLevelOpt = LogLevel.warning,
) -> None:
    """Print the local directory of --model (converting the bundled GGUF once): vLLM's --model."""
    setup_logging(log_level)
    from kvsplice.client.model.models import model_directory

    typer.echo(str(model_directory(model_config(model, model_cache))))


@bench_app.command("vllm")
def bench_vllm(
    json_path: Annotated[Path, typer.Option("--json", help="Write the results JSON here.")],
    configs: Annotated[str, typer.Option("--configs", help=CONFIGS_HELP)] = "",
    answer_tokens: Annotated[
        int, typer.Option(min=16, max=1024, help="Tokens each agent generates (min = max).")
    ] = 128,
    problem: Annotated[
        int, typer.Option(min=0, max=163, help="HumanEval problem index (129: the longest).")
    ] = 129,
    threads: Annotated[
        str, typer.Option(help="CPU cores every engine is pinned to (VLLM_CPU_OMP_THREADS_BIND).")
    ] = "0-1",
    dtype: Annotated[
        str,
        typer.Option(
            help="Engine dtype: float32, bfloat16 or float16. In bfloat16 a prefix loaded from "
            "anywhere (vLLM's own prefix cache too) rounds unlike one-pass prefill, so greedy "
            "outputs can part late in an answer."
        ),
    ] = "float32",
    work_dir: Annotated[
        Path, typer.Option(help="Sidecar data, connector storage and engine logs.")
    ] = Path("results/bench-vllm"),
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """5-agent transcript pipeline on real vLLM engines: TTFT per agent for recompute, vLLM's
    disk connector, LMCache, kvsplice (same host, gRPC, restarted sidecar) and vLLM's own
    prefix cache; writes --json."""
    setup_logging(log_level)
    if importlib.util.find_spec("vllm") is None:
        fail("vLLM is not installed here: run it from .venv-vllm (make vllm)")
    from kvsplice.client.model.models import model_directory
    from kvsplice.eval.bench.vllm_bench import CONFIGS, VllmBenchConfig, print_report, run_bench
    from kvsplice.eval.workloads.humaneval import load_humaneval

    names = tuple(c.strip() for c in configs.split(",") if c.strip()) or CONFIGS
    try:
        config = VllmBenchConfig(
            model_dir=str(model_directory(model_config(model, model_cache))),
            out_json=json_path, work_dir=work_dir, configs=names,
            answer_tokens=answer_tokens, threads=threads, problem_index=problem, dtype=dtype,
        )  # fmt: skip
    except ValueError as error:
        fail(str(error))
    task = load_humaneval(limit=problem + 1)[problem].question
    report = run_bench(config, task)
    print_report(report, console())
