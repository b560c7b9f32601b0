"""`kvsplice bench judge`: JCR of each reuse mode against the dense judge, with diagnostics.

Its own flags are `BenchJudgeConfig`'s fields (`eval.bench.judge.config`, torch-free); it
builds the config and hands it to `eval.bench.judge.bench`. Imports are lazy so `--help` never
loads torch.
"""

from __future__ import annotations

from typing import Any

from kvsplice.cli.common import console
from kvsplice.cli.config_options import with_parameters
from kvsplice.cli.worker import (
    WORKER_OPTIONS,
    _progress_bar,
    bench_app,
    bench_config,
    bench_parameters,
    load_for_bench,
    shared_fields,
    start_worker_command,
)
from kvsplice.eval.bench.judge.config import BenchJudgeConfig, default_max_new_tokens


@bench_app.command("judge")
@with_parameters(bench_parameters(BenchJudgeConfig, after=("store", *WORKER_OPTIONS)))
def bench_judge(**values: Any) -> None:
    """Judge Consistency Rate per mode vs the dense judge; writes JSON, markdown and PNG plots."""
    start_worker_command("bench judge", values)
    from kvsplice.eval.bench.judge.bench import run_bench_judge
    from kvsplice.eval.bench.judge.report import render_bench_judge

    config = bench_config(
        BenchJudgeConfig, values, policy_path=None, **shared_fields(values),
        max_new_tokens=values["max_new_tokens"] or default_max_new_tokens(values["task"]),
    )  # fmt: skip
    loaded, config = load_for_bench(config, values["policy"], "bench judge")
    out_console = console()
    bar, on_event = _progress_bar()
    with bar:
        result = run_bench_judge(config, loaded, progress=on_event)
    for renderable in render_bench_judge(result):
        out_console.print(renderable)
