"""The files and tables of a judge bench: results.json, results.md, the `--json` copy, plots.

Owns the markdown table, the CLI's rich view and `write_judge_files`; the figures
themselves are `judge_plots`'. What the numbers mean is documented on `jcr.ModeSummary`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from rich.console import RenderableType
from rich.text import Text

from kvsplice.eval.bench.judge.result import BenchJudgeResult
from kvsplice.eval.measure.jcr import ModeSummary
from kvsplice.eval.report.judge_plots import write_judge_plots
from kvsplice.eval.report.results import (
    fmt_ms,
    fmt_pct,
    fmt_x,
    markdown_table,
    rich_table,
    write_json,
)

logger = logging.getLogger(__name__)

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
# The candidate sets judged, in `bench judge --data` format.
CANDIDATES_JSONL = "candidates.jsonl"
HEADERS = (
    "mode", "examples", "JCR", "coverage", "JCR (text)", "cand. token·layer reuse",
    "token reuse", "TTFT ms", "speedup", "accuracy (dense)", "selected slot 1..n",
    "dense slot 1..n", "routes",
)  # fmt: skip


def summary_rows(summaries: Sequence[ModeSummary]) -> list[tuple[str, ...]]:
    return [_row(s) for s in summaries]


def _row(s: ModeSummary) -> tuple[str, ...]:
    bias = " ".join(f"{b:.0%}" for b in s.position_bias)
    dense_bias = " ".join(f"{b:.0%}" for b in s.dense_position_bias)
    routes = " ".join(f"{route} {n}" for route, n in s.routes.items())
    return (
        s.mode, str(s.examples), fmt_pct(s.jcr), fmt_pct(s.coverage), fmt_pct(s.jcr_text),
        fmt_pct(s.candidate_token_layer_reuse), fmt_pct(s.token_reuse), fmt_ms(s.mean_ttft_s),
        fmt_x(s.speedup), f"{fmt_pct(s.accuracy)} ({fmt_pct(s.dense_accuracy)})", bias,
        dense_bias, routes,
    )  # fmt: skip


def title(result: BenchJudgeResult) -> str:
    config = result.config
    order = "shuffled" if config.shuffle else "fixed"
    source = str(config.data_path) if config.data_path else (config.task or "gsm8k")
    return f"judge bench: {source}, {config.regime} regime, {order} order"


def results_markdown(result: BenchJudgeResult) -> str:
    examples = len(result.run.candidates)
    lines = [
        f"# {title(result)}",
        "",
        f"{examples} examples; JCR = share of examples where the mode's judge selects the same "
        "original agent as the dense judge of the byte-identical prompt (constrained read: "
        "argmax over the candidate labels at the decision position). Coverage: both generated "
        "texts named a candidate. Speedup: dense TTFT / mode TTFT, every reuse cost counted.",
        "",
        markdown_table(HEADERS, summary_rows(result.summaries)),
        "",
        f"Wall time {result.wall_s:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


def write_judge_files(result: BenchJudgeResult) -> dict[str, Path]:
    """results.json, results.md and the plots in `out_dir`, and the `--json` file; name → path."""
    out_dir = result.config.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    document = result.to_dict()
    files = {"json": write_json(out_dir / RESULTS_JSON, document)}
    if result.config.json_path is not None:
        files["--json"] = write_json(result.config.json_path, document)
    files["markdown"] = out_dir / RESULTS_MD
    files["markdown"].write_text(results_markdown(result), encoding="utf-8")
    files.update(write_judge_plots(result.summaries, result.attention, out_dir, title(result)))
    files["candidates"] = write_candidate_sets(result, out_dir / CANDIDATES_JSONL)
    return files


def write_candidate_sets(result: BenchJudgeResult, path: Path) -> Path:
    """The judged candidate sets in `--data` format (agent order), so that they can be
    judged again (another policy, another mode) without generating them."""
    lines = []
    for example in result.examples:
        candidates = result.run.candidates[example.example_id]
        record = {"id": example.example_id, "task": example.task, "question": example.question,
                  "candidates": list(candidates.texts.values())}  # fmt: skip
        if example.reference is not None:
            record["answer"] = example.reference
        lines.append(json.dumps(record, ensure_ascii=False) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
    return path


def render_bench_judge(result: BenchJudgeResult) -> list[RenderableType]:
    """The CLI's view: the table, then where the files are."""
    files = "\n".join(f"  {name}: {path}" for name, path in result.files.items())
    return [
        rich_table(title(result), HEADERS, summary_rows(result.summaries)),
        Text(f"wall time {result.wall_s:.0f} s; files:\n{files}"),
    ]
