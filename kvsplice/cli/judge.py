"""`kvsplice bench judge`: JCR of each reuse mode against the dense judge, with diagnostics.

Reads the flags, builds a `BenchJudgeConfig` and hands it to `eval.bench_judge`; imports
are lazy so `--help` never loads torch.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from kvsplice.cli.common import (
    DEFAULT_MODEL_CACHE,
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
from kvsplice.cli.worker import (
    MODES_HELP,
    StoreOpt,
    _progress_bar,
    apply_threads,
    bench_app,
    load_for_bench,
    model_config,
)


# The library's own tuples (agents.judge_prompts.TASKS, agents.judge.REGIMES and
# JUDGE_LAYOUTS) import
# torch-free modules, but tests still check these stay equal to them.
class Task(StrEnum):
    gsm8k = "gsm8k"
    mmlu = "mmlu"
    humaneval = "humaneval"


class Regime(StrEnum):
    progressive = "progressive"
    parallel = "parallel"


class JudgeLayout(StrEnum):
    persona_first = "persona-first"
    transcript = "transcript"


# A HumanEval candidate is a whole function: 48 tokens cut most of them before the tests can pass.
MAX_NEW_TOKENS = {Task.humaneval: 160}
DEFAULT_MAX_NEW_TOKENS = 48


def default_max_new_tokens(task: Task | None) -> int:
    return MAX_NEW_TOKENS.get(task, DEFAULT_MAX_NEW_TOKENS) if task else DEFAULT_MAX_NEW_TOKENS


@bench_app.command("judge")
def bench_judge(
    task: Annotated[
        Task | None,
        typer.Option(
            help="Task format of the judge prompt and of the questions (default gsm8k; with "
            "--data: every task in the file, or only this one)."
        ),
    ] = None,
    regime: Annotated[
        Regime,
        typer.Option(
            help="How the execution agents produce the candidates: progressive (agent i sees "
            "the answers of agents before it) or parallel (independent)."
        ),
    ] = Regime.progressive,
    layout: Annotated[
        JudgeLayout,
        typer.Option(
            help="transcript: one group conversation, the agents speaking in display order "
            "and the judge last, so a progressive agent's answer is in the judge prompt's "
            "exact chain (how a pipeline on kvsplice lays its judge out); persona-first: "
            "each agent under its own system prompt, the judge quoting the answers in a "
            "prompt of its own (no candidate in an exact chain: seed 001's setting)."
        ),
    ] = JudgeLayout.transcript,
    candidates: Annotated[
        int, typer.Option("--candidates", min=2, max=8, help="Execution agents (candidates).")
    ] = 4,
    shuffle: Annotated[
        bool,
        typer.Option(
            "--shuffle/--no-shuffle",
            help="Shuffle the candidates' display order per example (seeded); the dense and "
            "the reuse judge of an example see the same order.",
        ),
    ] = True,
    modes: Annotated[
        str | None,
        typer.Option(
            help=MODES_HELP + " 'gated' is the admission policy with the risk gate above it, "
            "as a worker runs it. Default: every mode."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the per-example permutations.")] = 0,
    policy: Annotated[
        Path | None,
        typer.Option(
            "--policy",
            exists=True,
            dir_okay=False,
            help="Admission policy JSON for this model: what 'gated' runs and the base "
            "parameters of every variant (default: the policy shipped for the model, "
            "SmolLM2-135M's, else the built-in safe one).",
        ),
    ] = None,
    json_out: Annotated[
        Path | None,
        typer.Option("--json", help='Also write the result here: {"modes": [...], ...}.'),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="JSONL of candidate sets to judge instead of generating them: one "
            '{"id", "task", "question", "candidates": [2-8 strings], "answer"?} per line.',
        ),
    ] = None,
    examples: Annotated[int, typer.Option(min=1, help="Examples judged (the first ones).")] = 8,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Tokens each execution agent may generate (default: 160 for humaneval, whose "
            "candidates are whole functions graded by their tests; 48 otherwise).",
        ),
    ] = None,
    diagnostics: Annotated[
        bool, typer.Option(help="Attention diagnostics per layer (one more forward per call).")
    ] = True,
    out: Annotated[
        Path, typer.Option("--out", help="Where results.json, .md and plots go.")
    ] = Path("results/bench_judge"),
    store: StoreOpt = None,
    auth_token: AuthTokenOpt = None,
    model: ModelOpt = "smollm2",
    model_cache: ModelCacheOpt = DEFAULT_MODEL_CACHE,
    dtype: DtypeOpt = Dtype.auto,
    threads: ThreadsOpt = None,
    log_level: LogLevelOpt = LogLevel.warning,
) -> None:
    """Judge Consistency Rate per mode vs the dense judge; writes JSON, markdown and PNG plots."""
    require_worker("bench judge")
    from kvsplice.eval.bench.judge import BenchJudgeConfig, run_bench_judge
    from kvsplice.eval.report.judge_report import render_bench_judge

    setup_logging(log_level)
    apply_threads(threads)
    try:
        config = BenchJudgeConfig(
            task=None if task is None else task.value, regime=regime.value,
            num_candidates=candidates, shuffle=shuffle, layout=layout.value, seed=seed,
            examples=examples,
            max_new_tokens=max_new_tokens or default_max_new_tokens(task), data_path=data, out_dir=out, json_path=json_out,
            store_target=store, store_token=auth_token or None, diagnostics=diagnostics,
            model=model_config(model, model_cache, dtype),
            **({} if modes is None else {"modes": tuple(modes.split(","))}),
        )  # fmt: skip
    except ValueError as error:
        fail(f"invalid settings: {error}", 2)
    loaded, config = load_for_bench(config, policy, "bench judge")
    out_console = console()
    bar, on_event = _progress_bar()
    with bar:
        result = run_bench_judge(config, loaded, progress=on_event)
    for renderable in render_bench_judge(result):
        out_console.print(renderable)
