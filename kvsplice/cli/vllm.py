"""`kvsplice model-dir` and `kvsplice bench vllm`: the model an engine serves, and the engine benchmark.

`bench vllm` runs from the vLLM virtualenv (`make vllm`); imports are lazy so `--help`
never loads torch or vLLM.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
from pathlib import Path
from typing import Annotated, Any

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
from kvsplice.cli.config_options import with_parameters
from kvsplice.cli.worker import bench_app, bench_config, bench_parameters, model_config
from kvsplice.eval.bench.vllm.config import VllmBenchConfig

# bench vllm logs at info (its progress), unlike the other bench commands
LOG_LEVEL = inspect.Parameter(
    "log_level", inspect.Parameter.KEYWORD_ONLY, default=LogLevel.info, annotation=LogLevelOpt
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
@with_parameters([*bench_parameters(VllmBenchConfig, after=("model", "model_cache")), LOG_LEVEL])
def bench_vllm(**values: Any) -> None:
    """5-agent pipeline (transcript or persona-first) on real vLLM engines: TTFT per agent
    (median of --repeats) for recompute, vLLM's disk connector, LMCache, kvsplice (same host,
    gRPC, restarted sidecar, gated: approximate reuse asked for), each with vLLM's prefix cache
    on and off, and vLLM's own prefix cache; writes --json."""
    setup_logging(values["log_level"])
    if importlib.util.find_spec("vllm") is None:
        fail("vLLM is not installed here: run it from .venv-vllm (make vllm)")
    from kvsplice.client.model.models import model_directory
    from kvsplice.eval.bench.vllm.bench import run_bench
    from kvsplice.eval.bench.vllm.config import WORKLOAD_SIZES
    from kvsplice.eval.bench.vllm.printing import print_report
    from kvsplice.eval.workloads.graded_pipelines import PIPELINES

    model_dir = str(model_directory(model_config(values["model"], values["model_cache"])))
    config = bench_config(VllmBenchConfig, values, model_dir=model_dir)
    pipeline = PIPELINES[config.workload]
    timed = {config.problem_index} if config.workload == "humaneval" else set()
    used = timed | set(config.problems)
    # the warm-up runs (persona-first's, the graded runs'): a problem neither timed nor graded
    other = next(i for i in range(WORKLOAD_SIZES[config.workload]) if i not in used)
    warm_up, *graded = pipeline.problems([other, *config.problems])
    task = pipeline.problems([config.problem_index])[0].question if timed else warm_up.question
    report = run_bench(config, task, warm_up_task=warm_up.question, graded=graded)
    print_report(report, console())


@bench_app.command("vllm-graded")
def bench_vllm_graded(
    reports: Annotated[
        list[Path], typer.Argument(help="`bench vllm --problems` JSON files of one setup.")
    ],
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the pooled figures here.")
    ] = None,
    admit: Annotated[
        Path | None,
        typer.Option(
            "--admit",
            help="Write the engines' admission policy here, with the graded yardstick's "
            "decision per configuration (`decisions`): a mode is admitted only where its "
            "configuration is, every negative control is refused and exact is admitted.",
        ),
    ] = None,
    held_out: Annotated[
        Path | None,
        typer.Option(
            "--held-out",
            help="An admission policy --admit wrote: check that these reports, of the "
            "rule's held-out problems, confirm the modes it admits.",
        ),
    ] = None,
    rule: Annotated[
        Path | None,
        typer.Option(
            "--rule",
            help="The yardstick's rule (default: the committed "
            "eval/bench/vllm/yardstick_rule.json; it must be committed before the runs).",
        ),
    ] = None,
) -> None:
    """Pool the graded answers of several `bench vllm --problems` runs (same model, dtype,
    layout, answer length, workload; disjoint problems): accuracy per role, each
    configuration's difference from recompute; with --admit, the yardstick's decisions and
    the engines' admission policy they give; with --held-out, whether held-out runs confirm
    one."""
    from kvsplice.eval.bench.vllm.graded import pool, print_graded

    if admit is not None and held_out is not None:
        fail("--admit calibrates, --held-out confirms: one at a time")
    try:
        loaded = [json.loads(path.read_text()) for path in reports]
        pooled = pool(loaded)
    except (OSError, ValueError, KeyError) as exc:  # JSONDecodeError is a ValueError
        fail(f"cannot pool {', '.join(map(str, reports))}: {exc!r}")
    pooled["files"] = [str(path) for path in reports]
    if admit is not None or held_out is not None:
        pooled["admission"] = _admission(loaded, pooled, admit, held_out, rule)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(pooled, indent=2))
    print_graded(pooled["configs"], console())
    console().print(f"{pooled['problems']} problems from {pooled['reports']} reports")
    if "admission" in pooled:
        _print_decisions(pooled["admission"]["decisions"])
        console().print(pooled["admission"]["summary"])


@bench_app.command("yardstick-draw")
def bench_yardstick_draw(
    workload: Annotated[str, typer.Argument(help="mmlu, gsm8k or humaneval.")],
    count: Annotated[int, typer.Option("--count", min=1, help="Problems to print.")],
    skip: Annotated[
        int, typer.Option("--skip", min=0, help="Leave out the draw's first N (run already).")
    ] = 0,
    rule: Annotated[
        Path | None,
        typer.Option("--rule", help="The yardstick's rule (default: the committed one)."),
    ] = None,
) -> None:
    """Print the calibration problems `bench vllm --problems` grades next, comma-separated:
    the rule's seeded order of the test split without its held-out draw, from --skip on.
    `bench vllm-graded --admit` accepts only the head of this order, pooled."""
    from kvsplice.eval.bench.vllm import yardstick as ys
    from kvsplice.eval.bench.vllm.config import WORKLOAD_SIZES

    if workload not in WORKLOAD_SIZES:
        fail(f"unknown workload {workload!r}: one of {', '.join(WORKLOAD_SIZES)}")
    try:
        loaded = ys.load_rule(rule or ys.RULE_PATH)
    except (OSError, ValueError) as exc:
        fail(f"cannot read the rule: {exc}")
    draw = loaded.calibration_draw(workload, WORKLOAD_SIZES[workload], skip + count)
    typer.echo(",".join(str(i) for i in draw[skip:]))


def _admission(
    loaded: list[dict[str, Any]], pooled: dict[str, Any], admit: Path | None,
    held_out: Path | None, rule_path: Path | None,
) -> dict[str, Any]:  # fmt: skip
    """--admit's policy (written) or --held-out's confirmation, as the pooled JSON's
    `admission`."""
    from kvsplice.client.modes.admission import AdmissionPolicy, save_policy
    from kvsplice.eval.bench.vllm import admission as va
    from kvsplice.eval.bench.vllm import yardstick as ys

    try:
        path = rule_path or ys.RULE_PATH
        rule = ys.load_rule(path)
        fingerprint = va.report_fingerprint(loaded)
        if admit is not None:
            policy, summary = va.admit(loaded, pooled, fingerprint, rule, path)
            save_policy(policy, admit)
            return {
                "decisions": list(policy.decisions), "yardstick": policy.yardstick,
                "policy": str(admit), "summary": f"{admit} {summary}",
            }  # fmt: skip
        assert held_out is not None
        policy = AdmissionPolicy.from_json(held_out.read_text())
        confirmed, why, found = va.confirm(loaded, pooled, policy, fingerprint, rule)
    except (OSError, ValueError, KeyError) as exc:
        fail(f"cannot decide admission: {exc}")
    word = "confirms" if confirmed else "does NOT confirm"
    return {
        "decisions": [d.as_json() for d in found], "policy": str(held_out),
        "confirmed": confirmed, "summary": f"held out: {word} {held_out} ({why})",
    }  # fmt: skip


def _share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} s"


def _print_decisions(decisions: list[dict[str, Any]]) -> None:
    from kvsplice.eval.report.tables import figures_table

    columns = (
        "config",
        "admitted",
        "points (95%)",
        "problems",
        "discordant",
        "recompute acc.",
        "loaded 2-5",
        "agent 5 TTFT",
        "reason",
    )
    table = figures_table(columns, ("config", "reason"), title="the graded yardstick")
    for d in decisions:
        low, high = d["ci95"]
        accuracy = " ".join(f"{role} {100 * a:.0f}%" for role, a in d["recompute_accuracy"].items())
        table.add_row(
            d["config"], "yes" if d["admitted"] else "no", f"{d['points']:+.1f} ({low:+.1f} to {high:+.1f})",
            str(d["problems"]), str(d["discordant"]), accuracy,
            _share(d.get("loaded_share_agents_2_5")), _seconds(d.get("agent5_ttft_s")), d["reason"],
        )  # fmt: skip
    console().print(table)
