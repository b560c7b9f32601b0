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
from kvsplice.eval.bench.vllm_bench_config import VllmBenchConfig

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
    from kvsplice.eval.bench.vllm_bench import print_report, run_bench
    from kvsplice.eval.workloads.humaneval import load_humaneval

    model_dir = str(model_directory(model_config(values["model"], values["model_cache"])))
    config = bench_config(VllmBenchConfig, values, model_dir=model_dir)
    used = {config.problem_index, *config.problems}
    problems = load_humaneval(limit=max(used) + 2)
    task = problems[config.problem_index].question
    # persona-first's warm-up: a problem neither timed nor graded
    other = problems[next(i for i in range(len(problems)) if i not in used)].question
    graded = [problems[i] for i in config.problems]
    report = run_bench(config, task, warm_up_task=other, graded=graded)
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
            help="Write the engines' admission policy here: naive admitted where "
            "the graded answers show it losing at most --tolerance-points against recompute.",
        ),
    ] = None,
    held_out: Annotated[
        Path | None,
        typer.Option(
            "--held-out",
            help="An admission policy --admit wrote: check that these reports, "
            "of problems its calibration never graded, confirm it.",
        ),
    ] = None,
    tolerance_points: Annotated[
        float, typer.Option(help="Accuracy points the admitted mode may lose.", min=0, max=100)
    ] = 2.0,
    min_answers: Annotated[
        int, typer.Option(help="Graded answers --admit needs at least.", min=1)
    ] = 300,
    config: Annotated[
        str | None,
        typer.Option(
            "--config", help="The configuration judged (default: the kvsplice-gated one)."
        ),
    ] = None,
) -> None:
    """Pool the graded answers of several `bench vllm --problems` runs (same model, dtype,
    layout, answer length; disjoint problems): accuracy per role and over all graded
    answers, each configuration's difference from recompute with its 95% interval; with
    --admit, the engines' admission policy those answers decide; with --held-out, whether
    runs of other problems confirm one."""
    from kvsplice.eval.bench.vllm_graded import pool, print_graded

    if admit is not None and held_out is not None:
        fail("--admit calibrates, --held-out confirms: one at a time")
    try:
        loaded = [json.loads(path.read_text()) for path in reports]
        pooled = pool(loaded)
    except (OSError, ValueError, KeyError) as exc:  # JSONDecodeError is a ValueError
        fail(f"cannot pool {', '.join(map(str, reports))}: {exc!r}")
    pooled["files"] = [str(path) for path in reports]
    if admit is not None or held_out is not None:
        pooled["admission"] = _admission(loaded, pooled, admit, held_out, config,
                                         tolerance_points, min_answers)  # fmt: skip
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(pooled, indent=2))
    print_graded(pooled["configs"], console())
    console().print(f"{pooled['problems']} problems from {pooled['reports']} reports")
    if "admission" in pooled:
        console().print(pooled["admission"]["summary"])


def _admission(
    loaded: list[dict[str, Any]], pooled: dict[str, Any], admit: Path | None,
    held_out: Path | None, config: str | None, tolerance_points: float, min_answers: int,
) -> dict[str, Any]:  # fmt: skip
    """--admit's policy (written) or --held-out's confirmation, as the pooled JSON's
    `admission`."""
    from kvsplice.client.modes.admission import AdmissionPolicy, save_policy
    from kvsplice.eval.bench import vllm_admission as va

    try:
        rule = va.AdmissionRule(tolerance_points, min_answers)
        label = va.gated_label(pooled, config)
        fingerprint = va.report_fingerprint(loaded)
        if admit is not None:
            verdict = va.judge(va.evidence(pooled, label, rule, va.workload_of(loaded[0])), rule)
            save_policy(va.admission_policy(fingerprint, verdict), admit)
            what = "admits naive" if verdict.admitted else "admits exact only"
            return {
                "calibration": verdict.as_json(), "policy": str(admit), "config": label,
                "summary": f"{admit} {what} for {fingerprint}: {verdict.reason}",
            }  # fmt: skip
        assert held_out is not None
        policy = AdmissionPolicy.from_json(held_out.read_text())
        verdict, together = va.confirm(pooled, policy, fingerprint, label, rule)
    except (OSError, ValueError, KeyError) as exc:
        fail(f"cannot decide admission: {exc}")
    word = "confirms" if verdict.admitted else "does NOT confirm"
    return {
        "held_out": verdict.as_json(), "policy": str(held_out), "config": label,
        "with_calibration": va.figures(together),
        "summary": f"held out: {word} {held_out} ({verdict.reason})",
    }  # fmt: skip
