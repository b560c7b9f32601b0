"""Worker-side commands: `kvsplice demo`, `calibrate` and the `bench` group (agents, core, store).

All but `bench store` need the `worker` extra (torch, transformers); each checks that first
and says which extra to install in one line. Imports are lazy: `--help` never loads torch.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from kvsplice.cli.common import (
    DEFAULT_MODEL_CACHE,
    PACKAGED_MODEL_NAMES,
    AuthTokenOpt,
    Dtype,
    DtypeOpt,
    LogLevel,
    LogLevelOpt,
    ModelCacheOpt,
    ModelOpt,
    ThreadsOpt,
    console,
    fail,
    int_tuple,
    require_worker,
    setup_logging,
)

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios measured in one run).")


# The library's own tuples (eval.bench.agents.WORKLOADS, eval.bench.mode_runner.GRAPHS,
# kvmath.quant.QUANT_SCHEMES) import torch; tests check these stay equal to them.
class Workload(StrEnum):
    synthetic = "synthetic"
    humaneval = "humaneval"
    math = "math"
    mc = "mc"
    gsm8k = "gsm8k"
    mmlu = "mmlu"


WORKLOAD_HELP = (
    "Task set. humaneval: the real HumanEval problems (in file order), graded by running their "
    "tests; gsm8k / mmlu: the real test sets (`make eval-data`), a subset drawn by --seed; "
    "math / mc: the small shipped samples (or --data); synthetic: fixed-shape random text."
)


class Graph(StrEnum):
    fully_connected = "fully_connected"
    chain = "chain"


class Quant(StrEnum):
    none = "none"
    fp16 = "fp16"
    int8 = "int8"


class Layout(StrEnum):
    """Prompt layouts (kvsplice.agents.layouts.LAYOUTS)."""

    persona_first = "persona-first"
    shared_first = "shared-first"
    transcript = "transcript"


LAYOUT_HELP = (
    "Where personas, the shared context and answers go: persona-first (KVComm's: each agent's "
    "own system prompt first), shared-first (a common preamble, the question and earlier "
    "answers first, each role's instruction last) or transcript (one growing group "
    "conversation: an agent prefills only its own turn). Fidelity is measured against dense "
    "prefill of the same layout."
)


StoreOpt = Annotated[
    str | None,
    typer.Option(
        "--store",
        envvar="KVSPLICE_STORE",
        help="host:port of a running sidecar; default: embedded.",
    ),
]
MODES_HELP = (
    "Comma-separated mode variants; dense is the baseline. A variant is a mode, optionally "
    "with parameters after ':' joined by '+': blend:r=0.43, halo:h=4+eps=0.05, "
    "anchor:gamma=0.5+tau=0.1+metric=key+r=0.15, multicut:cut=16. Each mode's parameters "
    "(names, ranges, defaults) are its `Params` in kvsplice.client.modes; a parameter the "
    "mode does not take is refused with that list."
)


def check_model(model: str) -> None:
    """A packaged model whose packages are missing fails in one line naming what installs it."""
    if model in PACKAGED_MODEL_NAMES:
        from kvsplice.client.model.packaged_models import PACKAGED_MODELS, ModelNotInstalledError

        try:
            PACKAGED_MODELS[model].part_paths()
        except ModelNotInstalledError as error:
            fail(str(error))
    elif not Path(model).expanduser().is_dir():
        raise typer.BadParameter(
            f"{model!r} is neither one of {', '.join(PACKAGED_MODEL_NAMES)} nor a model directory",
            param_hint="'--model'",
        )


def model_config(model: str, model_cache: Path, dtype: Dtype = Dtype.auto):
    """The `ModelConfig` of the flags; `auto` is the packaged model's own dtype (else float32)."""
    from kvsplice.client.model.models import ModelConfig
    from kvsplice.client.model.packaged_models import PACKAGED_MODELS

    check_model(model)
    name = dtype.value
    if dtype is Dtype.auto:
        packaged = PACKAGED_MODELS.get(model)
        name = packaged.dtype if packaged else "float32"
    return ModelConfig(source=model, cache_dir=model_cache, dtype=name)


def apply_threads(threads: int | None) -> int:
    """Set torch's thread count (None: the CPU cores) and return it."""
    import os

    import torch

    count = threads or os.cpu_count() or 1
    torch.set_num_threads(count)
    return count


C = TypeVar("C")  # a bench config (BenchAgentsConfig, BenchJudgeConfig): imports torch


def load_for_bench(config: C, policy: Path | None, command: str) -> tuple[Any, C]:
    """`config.model` loaded (saying so on the console), and `config` with the `--policy`
    file's admission applied when given (a bad file or another model's: `BadParameter`)."""
    from dataclasses import replace

    from kvsplice.client.model.models import load_model
    from kvsplice.client.modes.admission import load_policy
    from kvsplice.common.errors import FingerprintMismatch

    console().print(f"[bold]kvsplice {command}[/]: loading the model")
    loaded = load_model(config.model)  # type: ignore[attr-defined]
    if policy is None:
        return loaded, config
    try:
        admission = load_policy(policy, loaded.fingerprint)
    except (FingerprintMismatch, ValueError) as error:
        raise typer.BadParameter(str(error), param_hint="'--policy'") from error
    return loaded, replace(config, admission=admission, policy_path=policy)  # type: ignore[type-var]


def _progress_bar():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )
    task = bar.add_task("agent calls", total=None)

    def on_event(event: Any) -> None:  # eval.mode_runner.ProgressEvent (imports torch)
        bar.update(task, completed=event.done, total=event.total, description=event.message[:60])

    return bar, on_event


def demo(
    store: StoreOpt = None,
    problems: Annotated[int, typer.Option(min=1, max=164, help="HumanEval problems.")] = 3,
    modes: Annotated[
        str | None,
        typer.Option(help=MODES_HELP + " Default: dense, exact, what --policy admits, then naive."),
    ] = None,
    layout: Annotated[Layout, typer.Option(help=LAYOUT_HELP)] = Layout.transcript,
    policy: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="Admission policy JSON (kvsplice calibrate): its admitted modes join the "
            "default --modes, and 'gated' (the policy with the judge risk gate above it, in the "
            "pipeline and in the closing judge stage) runs it. Default: the policy shipped "
            "for the model (SmolLM2-135M), else only exact and dense.",
        ),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens each agent generates.")] = 32,
    out_dir: Annotated[
        Path, typer.Option("--out", help="Where demo.json and the TTFT chart go (created).")
    ] = Path("results/demo"),
    auth_token: AuthTokenOpt = None,
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    dtype: DtypeOpt = Dtype.auto,
    threads: ThreadsOpt = None,
    log_level: LogLevelOpt = LogLevel.warning,
) -> None:
    """The 5-agent HumanEval pipeline in each mode against the store, then a judge over each
    problem's answers with the risk gate at work; prints TTFT, fidelity, JCR and the gate's routes."""
    require_worker("demo")
    from kvsplice.client.model.models import load_model
    from kvsplice.eval.bench.agents_demo import DemoConfig, demo_modes, render_demo, run_agents_demo

    setup_logging(log_level)
    model_settings = model_config(model, model_cache, dtype)
    apply_threads(threads)
    loaded = load_model(model_settings) if policy is not None and modes is None else None
    try:
        config = DemoConfig(
            store_target=store,
            store_token=auth_token or None,
            num_problems=problems,
            modes=tuple(modes.split(",")) if modes else demo_modes(policy, loaded),
            layout=layout.value,
            max_new_tokens=max_new_tokens,
            out_dir=out_dir,
            model=model_settings,
            policy_path=policy,
        )
    except ValueError as error:
        fail(f"invalid settings: {error}", 2)
    out = console()
    out.print("[bold]kvsplice demo[/]: loading the model (the first run converts the GGUF once)")
    bar, on_event = _progress_bar()
    with bar:
        result = run_agents_demo(config, progress=on_event, loaded=loaded)
    for renderable in render_demo(result):
        out.print(renderable)


@bench_app.command("agents")
def bench_agents(
    workload: Annotated[Workload, typer.Option(help=WORKLOAD_HELP)] = Workload.synthetic,
    agents: Annotated[int, typer.Option("--agents", min=2, max=5, help="Agents per graph.")] = 5,
    modes: Annotated[str, typer.Option(help=MODES_HELP)] = "dense,exact,naive",
    policy: Annotated[
        Path | None,
        typer.Option(
            "--policy",
            exists=True,
            dir_okay=False,
            help="Admission policy JSON (kvsplice calibrate) for this model: the base "
            "parameters of every variant (default: built-in defaults). Nothing is gated on it.",
        ),
    ] = None,
    samples: Annotated[int, typer.Option(min=1, help="Tasks per variant.")] = 3,
    seed: Annotated[
        int, typer.Option(help="Draws the gsm8k/mmlu subset and the synthetic text.")
    ] = 0,
    graph: Annotated[Graph, typer.Option(help="Agent graph.")] = Graph.fully_connected,
    layout: Annotated[
        str,
        typer.Option(
            help=LAYOUT_HELP + " Several, comma-separated, run one after another on the same "
            "problems and write layouts.md / layouts.json beside their results."
        ),
    ] = "persona-first",
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens each agent generates.")] = 64,
    prefix_len: Annotated[int, typer.Option(min=1, help="synthetic: system prompt tokens")] = 512,
    input_len: Annotated[int, typer.Option(min=1, help="synthetic: user input tokens")] = 256,
    response_len: Annotated[int, typer.Option(min=1, help="synthetic: tokens per response")] = 128,
    quant: Annotated[Quant, typer.Option(help="Payload encoding in the store.")] = Quant.none,
    data: Annotated[
        Path | None,
        typer.Option(exists=True, dir_okay=False, help="GSM8K/MMLU-format JSONL for math/mc."),
    ] = None,
    out: Annotated[
        Path, typer.Option("--out", help="Where results.json, .md and plots go.")
    ] = Path("results/bench_agents"),
    store: StoreOpt = None,
    store_memory_mib: Annotated[
        int,
        typer.Option(
            min=1,
            help="Embedded store's memory (every variant's namespace shares it; when full, "
            "the least recently used segments and anchors go, and the run names each mode "
            "that lost any: its reuse is then understated). Every mode of the README's "
            "synthetic run stores ~3.4 GiB (11 modes); give it 8192.",
        ),
    ] = 2048,
    auth_token: AuthTokenOpt = None,
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    dtype: DtypeOpt = Dtype.auto,
    threads: ThreadsOpt = None,
    log_level: LogLevelOpt = LogLevel.warning,
) -> None:
    """Multi-agent TTFT, reuse and fidelity per mode variant; writes JSON, markdown and PNG plots."""
    require_worker("bench agents")
    from kvsplice.agents.layouts import check_layout
    from kvsplice.eval.bench.agents import BenchAgentsConfig, run_bench_agents, run_bench_layouts
    from kvsplice.eval.report.results import render_bench_agents

    setup_logging(log_level)
    apply_threads(threads)
    layouts = tuple(dict.fromkeys(layout.split(",")))
    try:  # bad modes and layouts fail before the model loads
        for name in layouts:
            check_layout(name)
        config = BenchAgentsConfig(
            workload=workload.value, num_agents=agents, modes=tuple(modes.split(",")), samples=samples,
            graph=graph.value, layout=layouts[0], max_new_tokens=max_new_tokens, prefix_len=prefix_len, input_len=input_len,
            response_len=response_len, out_dir=out, store_target=store, store_token=auth_token or None,
            quant=quant.value, data_path=data, model=model_config(model, model_cache, dtype), seed=seed,
            store_memory_mib=store_memory_mib,
        )  # fmt: skip
    except ValueError as error:
        fail(f"invalid settings: {error}", 2)
    loaded, config = load_for_bench(config, policy, "bench agents")
    out_console = console()
    bar, on_event = _progress_bar()
    with bar:
        if len(layouts) == 1:
            results, files = [run_bench_agents(config, loaded, progress=on_event)], {}
        else:
            results, files = run_bench_layouts(config, layouts, loaded, progress=on_event)
    for result in results:
        out_console.print(f"[bold]{result.config.layout} layout[/]")
        for renderable in render_bench_agents(result):
            out_console.print(renderable)
    for name, path in files.items():
        out_console.print(f"{name}: {path}")


def calibrate(
    out: Annotated[
        Path, typer.Option("--out", help="Where to write the admission policy JSON.")
    ] = Path("policy.json"),
    probes: Annotated[
        int, typer.Option(min=1, help="Probe questions (math workload); anchor needs >= 3.")
    ] = 4,
    agents: Annotated[int, typer.Option("--agents", min=2, max=5, help="Agents per graph.")] = 3,
    max_kl: Annotated[
        float,
        typer.Option(help="Admit a mode only if its mean first-token KL is at most this (nats)."),
    ] = 0.05,
    min_agreement: Annotated[
        float, typer.Option(help="... and its first-token agreement with dense is at least this.")
    ] = 0.95,
    judge_probes: Annotated[
        int,
        typer.Option(
            min=0,
            help="Judge probes: the first examples of --judge-data (each judged in "
            "--judge-orders shuffled orders) on which each judge mode's grid is tried; "
            "0: none (no mode admitted for judges).",
        ),
    ] = 6,
    judge_data: Annotated[
        Path | None,
        typer.Option(
            "--judge-data",
            exists=True,
            dir_okay=False,
            help="Your own candidate sets for the judge probes, in bench judge's --data "
            "format (one {id, task, question, candidates, answer?} per line); default: "
            "the shipped judge sample.",
        ),
    ] = None,
    judge_orders: Annotated[
        int, typer.Option(min=1, max=64, help="Shuffled orders (seeds 0..N-1) per judge probe.")
    ] = 2,
    min_jcr: Annotated[
        float,
        typer.Option(
            help="Admit a mode for judges only if its guarded JCR on the probes is at least this."
        ),
    ] = 0.98,
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    dtype: DtypeOpt = Dtype.auto,
    threads: ThreadsOpt = None,
    log_level: LogLevelOpt = LogLevel.warning,
) -> None:
    """Measure each approximate mode's drift vs dense on this model and write the admission policy."""
    require_worker("calibrate")
    apply_threads(threads)
    from kvsplice.eval.measure.calibrate import (
        CalibrationConfig,
        Thresholds,
        judge_examples,
        render_calibration,
        render_judge_probes,
        run_calibration,
        write_policy,
    )
    from kvsplice.eval.measure.judge_probes import JudgeThresholds

    setup_logging(log_level)
    try:
        config = CalibrationConfig(
            model=model_config(model, model_cache, dtype),
            probes=probes,
            num_agents=agents,
            thresholds=Thresholds(max_mean_kl=max_kl, min_first_token_agreement=min_agreement),
            judge_probes=judge_probes,
            judge_seeds=tuple(range(judge_orders)),
            judge_thresholds=JudgeThresholds(min_jcr=min_jcr),
            **({} if judge_data is None else {"judge_data": judge_data}),
        )
        judge_examples(config)  # a malformed --judge-data fails here, before the model loads
    except ValueError as error:
        fail(f"invalid settings: {error}", 2)
    out_console = console()
    result = run_calibration(config, progress=lambda message: out_console.log(message))
    out_console.print(render_calibration(result))
    if result.judge_probes:
        out_console.print(render_judge_probes(result))
    write_policy(result, out)
    judges = ", ".join(result.policy.judge_modes) or "none (judge-like calls run exact)"
    out_console.print(
        f"admitted: {', '.join(result.policy.admitted_modes)}; for judges: {judges} -> {out}"
    )


@bench_app.command("core")
def bench_core(
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    dtype: DtypeOpt = Dtype.auto,
    lengths: Annotated[str, typer.Option(help="Comma-separated prompt lengths.")] = "256,1024,2048",
    threads: Annotated[str, typer.Option(help="Comma-separated torch thread counts.")] = "1,2",
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per length.")] = 5,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the rows as JSON.")
    ] = None,
    log_level: LogLevelOpt = LogLevel.warning,
) -> None:
    """ReuseEngine's reuse call (and its fused splice into the cache) vs dense prefill vs memcpy."""
    import json

    require_worker("bench core")
    check_model(model)
    prompt_lengths = int_tuple(lengths, "--lengths")
    thread_counts = int_tuple(threads, "--threads")
    from kvsplice.client.model.models import load_model
    from kvsplice.eval.bench.core import core_bench_to_json, render_core_bench, run_core_bench

    setup_logging(log_level)
    loaded = load_model(model_config(model, model_cache, dtype))
    rows = run_core_bench(
        loaded, lengths=prompt_lengths, repeats=repeats, thread_counts=thread_counts
    )
    console().print(render_core_bench(rows))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(core_bench_to_json(rows), indent=2))


@bench_app.command("store")
def bench_store(
    sizes_mib: Annotated[
        str, typer.Option(help="Comma-separated segment sizes in MiB.")
    ] = "1,8,32",
    path_sizes_mib: Annotated[
        str, typer.Option(help="Sizes in MiB read same-host and over gRPC ('' : none).")
    ] = "8,32,128",
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per size.")] = 5,
    lookup_counts: Annotated[
        str, typer.Option(help="Comma-separated index sizes.")
    ] = "10000,100000",
    grpc_lookups: Annotated[bool, typer.Option(help="Also time lookups through gRPC.")] = True,
    tmp_dir: Annotated[
        Path | None,
        typer.Option(
            exists=True, file_okay=False, writable=True, help="Where the benchmark's LMDB lives."
        ),
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="Also write the result as JSON.")
    ] = None,
    log_level: LogLevelOpt = LogLevel.warning,
) -> None:
    """Get MB/s same-host vs gRPC, put/get per tier, all beside numpy.copyto; lookup p50/p99."""
    import json

    config_args = dict(
        sizes_mib=int_tuple(sizes_mib, "--sizes-mib"),
        path_sizes_mib=int_tuple(path_sizes_mib, "--path-sizes-mib") if path_sizes_mib else (),
        repeats=repeats,
        lookup_counts=int_tuple(lookup_counts, "--lookup-counts"),
        tmp_dir=str(tmp_dir) if tmp_dir else None,
        include_grpc_lookups=grpc_lookups,
    )
    from kvsplice.eval.bench.store import StoreBenchConfig, run_store_bench
    from kvsplice.eval.report.store_render import render_store_bench, store_bench_to_json

    setup_logging(log_level)
    try:
        config = StoreBenchConfig(**config_args)
    except ValueError as error:
        fail(f"invalid settings: {error}", 2)
    result = run_store_bench(config)
    out_console = console()
    for renderable in render_store_bench(result):
        out_console.print(renderable)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(store_bench_to_json(result), indent=2))
