"""Worker-side commands: `kvsplice demo`, `calibrate` and the `bench` group (agents, core, store).

All but `bench store` need the `worker` extra (torch, transformers); each checks that first
and says which extra to install in one line. Imports are lazy: `--help` never loads torch.
A bench command's own flags are its config's fields (`kvsplice.cli.config_options`, from the
torch-free `eval.bench.*.config` modules) and read no KVSPLICE_* variable: the environment
must not change a benchmark unseen. The flags every worker command shares (store, model,
threads, log level) are written once, below, and keep their variables.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import Field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, NoReturn, Protocol, TypeVar

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
    require_worker,
    setup_logging,
)
from kvsplice.cli.config_options import config_parameters, with_parameters
from kvsplice.client.model.model_config import ModelConfig
from kvsplice.common.config_flags import build_config
from kvsplice.eval.bench.agents.config import BenchAgentsConfig
from kvsplice.eval.bench.core.config import CoreBenchConfig
from kvsplice.eval.bench.demo.config import DemoConfig
from kvsplice.eval.bench.store.config import StoreBenchConfig

if TYPE_CHECKING:  # these modules import torch, or are slow to import for `--help`
    from rich.progress import Progress

    from kvsplice.client.model.models import LoadedModel
    from kvsplice.eval.bench.mode_runner import ProgressEvent

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (ratios measured in one run).")

StoreOpt = Annotated[
    str | None,
    typer.Option(
        "--store",
        envvar="KVSPLICE_STORE",
        help="host:port of a running sidecar; default: embedded.",
    ),
]
SHARED_OPTIONS = {  # name: (default, option)
    "store": (None, StoreOpt),
    "auth_token": (None, AuthTokenOpt),
    "model": ("smollm2", ModelOpt),
    "model_cache": (DEFAULT_MODEL_CACHE, ModelCacheOpt),
    "dtype": (Dtype.auto, DtypeOpt),
    "threads": (None, ThreadsOpt),
    "log_level": (LogLevel.warning, LogLevelOpt),
}
MODEL_OPTIONS = ("model", "model_cache", "dtype")
WORKER_OPTIONS = ("auth_token", *MODEL_OPTIONS, "threads", "log_level")


def bench_parameters(
    config: type, before: tuple[str, ...] = (), after: tuple[str, ...] = WORKER_OPTIONS
) -> list[inspect.Parameter]:
    """`config`'s flags (no variables) between the shared options `before` and `after`."""

    def shared(name: str) -> inspect.Parameter:
        default, option = SHARED_OPTIONS[name]
        return inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=option
        )

    own = config_parameters(config, envvar_prefix=None)
    return [*map(shared, before), *own, *map(shared, after)]


def check_model(model: str, model_cache: Path) -> None:
    """A packaged model neither converted in `model_cache` nor installed fails in one line
    naming what installs it; its packages are needed only to convert it."""
    if model in PACKAGED_MODEL_NAMES:
        from kvsplice.client.model.model_cache import cached_model_dir
        from kvsplice.client.model.packaged_models import PACKAGED_MODELS, ModelNotInstalledError

        packaged = PACKAGED_MODELS[model]
        if cached_model_dir(packaged, model_cache.expanduser()) is not None:
            return
        try:
            packaged.part_paths()
        except ModelNotInstalledError as error:
            fail(f"{error}; no converted copy in {model_cache} (--model-cache) either")
    elif not Path(model).expanduser().is_dir():
        raise typer.BadParameter(
            f"{model!r} is neither one of {', '.join(PACKAGED_MODEL_NAMES)} nor a model directory",
            param_hint="'--model'",
        )


def model_config(model: str, model_cache: Path, dtype: Dtype = Dtype.auto) -> ModelConfig:
    """The `ModelConfig` of the flags; `auto` is the packaged model's own dtype (else float32)."""
    from kvsplice.client.model.packaged_models import PACKAGED_MODELS

    check_model(model, model_cache)
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


C = TypeVar("C")  # a bench config


class ModelBenchConfig(Protocol):
    """A bench config that loads a model and carries the admission a `--policy` file gives."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # a dataclass: `replace` takes it

    @property
    def model(self) -> ModelConfig: ...


M = TypeVar("M", bound=ModelBenchConfig)


def start_worker_command(command: str, values: dict[str, Any]) -> None:
    """What a worker command built from a config does first: fail in one line without the
    worker extra, then set logging and torch's threads from its `log_level` and `threads`."""
    require_worker(command)
    setup_logging(values["log_level"])
    apply_threads(values["threads"])


def bench_config(config: type[C], values: dict[str, Any], **overrides: Any) -> C:
    """`config` of the flags' `values` and `overrides`; invalid settings fail in one line."""
    try:
        return build_config(config, values, **overrides)
    except ValueError as error:
        invalid(error)


def invalid(error: ValueError) -> NoReturn:
    fail(f"invalid settings: {error}", 2)


def shared_fields(values: dict[str, Any]) -> dict[str, Any]:
    """The fields the shared flags set: the store, its token and the model."""
    return {
        "store_target": values["store"],
        "store_token": values["auth_token"] or None,
        "model": model_config(values["model"], values["model_cache"], values["dtype"]),
    }


def write_json(path: str | Path | None, document: Any) -> None:
    """`document` as JSON at `path` (its folder created), unless `path` is None."""
    import json

    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(document, indent=2))


def load_for_bench(config: M, policy: Path | None, command: str) -> tuple[LoadedModel, M]:
    """`config.model` loaded (saying so on the console), and `config` with the `--policy`
    file's admission applied when given (a bad file or another model's: `BadParameter`)."""
    from dataclasses import replace

    from kvsplice.client.model.models import load_model
    from kvsplice.client.modes.admission import load_policy
    from kvsplice.common.errors import FingerprintMismatch

    console().print(f"[bold]kvsplice {command}[/]: loading the model")
    loaded = load_model(config.model)
    if policy is None:
        return loaded, config
    try:
        admission = load_policy(policy, loaded.fingerprint)
    except (FingerprintMismatch, ValueError) as error:
        raise typer.BadParameter(str(error), param_hint="'--policy'") from error
    return loaded, replace(config, admission=admission, policy_path=policy)


def _progress_bar() -> tuple[Progress, Callable[[ProgressEvent], None]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
    )
    task = bar.add_task("agent calls", total=None)

    def on_event(event: ProgressEvent) -> None:
        bar.update(task, completed=event.done, total=event.total, description=event.message[:60])

    return bar, on_event


@with_parameters(bench_parameters(DemoConfig, before=("store",)))
def demo(**values: Any) -> None:
    """The 5-agent HumanEval pipeline in each mode against the store, then a judge over each
    problem's answers with the risk gate at work; prints TTFT, fidelity, JCR and the gate's routes."""
    start_worker_command("demo", values)
    from kvsplice.client.model.models import load_model
    from kvsplice.eval.bench.demo.bench import demo_modes, render_demo, run_agents_demo

    shared = shared_fields(values)
    policy, modes = values["policy"], values["modes"]
    loaded = load_model(shared["model"]) if policy is not None and modes is None else None
    config = bench_config(DemoConfig, values, modes=modes or demo_modes(policy, loaded), **shared)
    out = console()
    out.print("[bold]kvsplice demo[/]: loading the model (the first run converts the GGUF once)")
    bar, on_event = _progress_bar()
    with bar:
        result = run_agents_demo(config, progress=on_event, loaded=loaded)
    for renderable in render_demo(result):
        out.print(renderable)


@bench_app.command("agents")
@with_parameters(bench_parameters(BenchAgentsConfig, after=("store", *WORKER_OPTIONS)))
def bench_agents(**values: Any) -> None:
    """Multi-agent TTFT, reuse and fidelity per mode variant; writes JSON, markdown and PNG plots."""
    start_worker_command("bench agents", values)
    from kvsplice.agents.layouts import check_layout
    from kvsplice.eval.bench.agents.bench import run_bench_agents, run_bench_layouts
    from kvsplice.eval.bench.agents.report import render_bench_agents

    layouts = tuple(dict.fromkeys(values["layout"].split(",")))
    try:  # bad modes and layouts fail before the model loads
        for name in layouts:
            check_layout(name)
    except ValueError as error:
        invalid(error)
    config = bench_config(
        BenchAgentsConfig, values, layout=layouts[0], policy_path=None, **shared_fields(values)
    )
    loaded, config = load_for_bench(config, values["policy"], "bench agents")
    out_console = console()
    bar, on_event = _progress_bar()
    with bar:
        files: dict[str, Path] = {}  # the side-by-side comparison, for more than one layout
        if len(layouts) == 1:
            results = [run_bench_agents(config, loaded, progress=on_event)]
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
    judge_variant: Annotated[
        str,
        typer.Option(
            help="Parameters every judge candidate sets, a variant's '+'-joined "
            "name=value list (e.g. 'q=1': crossfix also reuses the question); "
            "default: none.",
        ),
    ] = "",
    min_jcr: Annotated[
        float,
        typer.Option(
            help="Admit a mode for judges only if its held-out guarded JCR on the probes (two folds, each under the guard the other calibrated) is at least this."
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
    from kvsplice.eval.workloads.judge_examples import JUDGE_SAMPLE

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
            judge_variant=judge_variant,
            judge_data=JUDGE_SAMPLE if judge_data is None else judge_data,
        )
        judge_examples(config)  # a malformed --judge-data fails here, before the model loads
    except ValueError as error:
        invalid(error)
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
@with_parameters(bench_parameters(CoreBenchConfig, before=MODEL_OPTIONS, after=("log_level",)))
def bench_core(**values: Any) -> None:
    """ReuseEngine's reuse call (and its fused splice into the cache) vs dense prefill vs memcpy."""
    require_worker("bench core")
    model = model_config(values["model"], values["model_cache"], values["dtype"])
    config = bench_config(CoreBenchConfig, values, model=model)
    from kvsplice.client.model.models import load_model
    from kvsplice.eval.bench.core.bench import core_bench_to_json, render_core_bench, run_core_bench

    setup_logging(values["log_level"])
    loaded = load_model(config.model)
    rows = run_core_bench(
        loaded, lengths=config.lengths, repeats=config.repeats, thread_counts=config.thread_counts
    )
    console().print(render_core_bench(rows))
    write_json(config.json_path, core_bench_to_json(rows))


@bench_app.command("store")
@with_parameters(bench_parameters(StoreBenchConfig, after=("log_level",)))
def bench_store(**values: Any) -> None:
    """Get MB/s same-host vs gRPC, put/get per tier, all beside numpy.copyto; lookup p50/p99."""
    config = bench_config(StoreBenchConfig, values)
    from kvsplice.eval.bench.store.bench import run_store_bench
    from kvsplice.eval.bench.store.report import render_store_bench, store_bench_to_json

    setup_logging(values["log_level"])
    result = run_store_bench(config)
    out_console = console()
    for renderable in render_store_bench(result):
        out_console.print(renderable)
    write_json(config.json_path, store_bench_to_json(result))
