"""Bench results as files and tables: results.json, results.md, and rich tables for the CLI.

Owns the JSON layout (config, environment, aggregates, every call record
without tensors), the markdown tables and `render_bench_agents`. Numbers come
from `metrics`; images from `plots`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from kvsplice.eval.measure.metrics import (
    DENSE,
    Aggregates,
    CallRecord,
    GroupStats,
    SampleStats,
    by_sample,
)
from kvsplice.eval.report.plots import write_plots

if TYPE_CHECKING:
    from kvsplice.client.modes.admission import AdmissionPolicy
    from kvsplice.eval.bench.agents import BenchResult

logger = logging.getLogger(__name__)

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
PROTOCOL = (
    "Each mode variant runs against a fresh store namespace (variants never feed each other); "
    "one untimed warm-up sample per variant runs first in a throwaway namespace; variants are "
    "interleaved per sample (dense first) and samples run in sequence, so later samples "
    "may reuse earlier samples' template segments. TTFT covers everything up to the first "
    "token (lookups, fetch, decode, shift, base prefill, splice, prefill, first decode). "
    "Fidelity compares each call with dense prefill of the identical prompt on the same "
    "model, computed outside the call's TTFT; a dense-mode call is its own reference. "
    "Speedups are ratios of median TTFTs against dense in the same run. Token·layer reuse "
    "is the share of prompt tokens × layers whose K/V was reused rather than computed."
)
POSITION_HEADERS = (
    "agent",
    "mode",
    "calls",
    "prompt tok",
    "mean TTFT ms",
    "median TTFT ms",
    "speedup",
    "token reuse",
    "token·layer reuse",
    "calls reusing",
)
MODE_HEADERS = (
    "mode",
    "calls",
    "speedup",
    "token reuse",
    "token·layer reuse",
    "calls reusing",
    "1st-token agree",
    "mean KL",
    "max KL",
    "output match",
    "accuracy (pass@1)",
    "Δ accuracy vs dense",
)


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def fmt_pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.0%}"


def fmt_x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def fmt_kl(kl: float | None) -> str:
    return "-" if kl is None else f"{kl:.2e}"


def agent_labels(records: Sequence[CallRecord]) -> dict[int, str]:
    """Position → "1 planner" (agent id and role name of the first call seen there)."""
    labels: dict[int, str] = {}
    for record in records:
        labels.setdefault(record.position, f"{record.agent_id} {record.agent_name}")
    return labels


def position_rows(aggregates: Aggregates, records: Sequence[CallRecord]) -> list[tuple[str, ...]]:
    """One row per (agent position, mode), agents outermost."""
    labels = agent_labels(records)
    groups = sorted(aggregates.by_position, key=lambda g: g.position or 0)
    return [_position_row(g, labels.get(g.position or 0, str(g.position))) for g in groups]


def _position_row(group: GroupStats, label: str) -> tuple[str, ...]:
    return (
        label, group.mode, str(group.num_calls), f"{group.mean_prompt_tokens:.0f}",
        fmt_ms(group.mean_ttft_s), fmt_ms(group.median_ttft_s), fmt_x(group.speedup),
        fmt_pct(group.token_reuse_rate), fmt_pct(group.token_layer_reuse_rate),
        fmt_pct(group.call_reuse_rate),
    )  # fmt: skip


def mode_rows(aggregates: Aggregates) -> list[tuple[str, ...]]:
    """One row per mode variant: pipeline speedup, reuse, fidelity, task accuracy (pass@1
    for HumanEval) and its difference from dense's in points."""
    dense = next((g.accuracy for g in aggregates.by_mode if g.mode == DENSE), None)
    return [_mode_row(g, dense) for g in aggregates.by_mode]


def _mode_row(g: GroupStats, dense_accuracy: float | None) -> tuple[str, ...]:
    return (
        g.mode, str(g.num_calls), fmt_x(g.speedup), fmt_pct(g.token_reuse_rate),
        fmt_pct(g.token_layer_reuse_rate), fmt_pct(g.call_reuse_rate),
        fmt_pct(g.first_token_agreement), fmt_kl(g.mean_kl),
        fmt_kl(g.max_kl), fmt_pct(g.output_match),
        "-" if g.accuracy is None else f"{g.accuracy:.1%} of {g.num_scored}",
        _accuracy_delta(g, dense_accuracy),
    )  # fmt: skip


def _accuracy_delta(g: GroupStats, dense_accuracy: float | None) -> str:
    if g.mode == DENSE or g.accuracy is None or dense_accuracy is None:
        return "-"
    return f"{(g.accuracy - dense_accuracy) * 100:+.1f} pt"


def sample_rows(records: Sequence[CallRecord]) -> tuple[list[str], list[tuple[str, ...]]]:
    """Headers and one row per mode: each sample's "token reuse · 1st-token agreement"."""
    stats = by_sample(records)
    indices = sorted({s.sample_index for s in stats})
    cells: dict[str, dict[int, SampleStats]] = {}
    for s in stats:
        cells.setdefault(s.mode, {})[s.sample_index] = s
    rows = [(mode, *(_sample_cell(found.get(i)) for i in indices)) for mode, found in cells.items()]
    return ["mode", *(f"sample {i + 1}" for i in indices)], rows


def _sample_cell(stats: SampleStats | None) -> str:
    if stats is None:
        return "-"
    return f"{fmt_pct(stats.token_reuse_rate)} · {fmt_pct(stats.first_token_agreement)}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def results_markdown(result: BenchResult) -> str:
    """results.md: the setup, the per agent × mode TTFT table and the per-mode fidelity table."""
    config, env = result.config, result.environment
    setup = (
        f"{config.num_agents} agents, {config.graph} graph, {config.samples} samples, "
        f"modes {', '.join(config.modes)}, payload quant `{config.quant}`, reference `{config.reference}`."
        f" Variant parameters from {_policy_source(config.policy_path, config.admission)}."
    )
    if config.workload == "synthetic":
        setup += f" Synthetic shape: prefix {config.prefix_len}, input {config.input_len}, response {config.response_len} tokens."
    else:
        setup += f" Each agent generates at most {config.max_new_tokens} tokens."
    machine = (
        f"CPU {env.get('cpu')} ({env.get('num_cpus')} cores, {env.get('torch_num_threads')} torch threads, "
        f"load average {env.get('load_average')} at the end), GPU {env.get('gpu') or 'none'}, torch {env.get('torch')}, "
        f"{env.get('dtype')}, attention {env.get('attn_implementation')}, model `{env.get('model_fingerprint')}`."
    )
    if env.get("busy_machine_warning"):
        machine += f" **Warning: {env['busy_machine_warning']}.**"
    return "\n\n".join([
        f"# kvsplice bench agents: {config.workload}", setup, machine, PROTOCOL,
        "## TTFT per agent and mode",
        markdown_table(POSITION_HEADERS, position_rows(result.aggregates, result.records)),
        "## Fidelity per mode (vs dense prefill of the identical prompt)",
        markdown_table(MODE_HEADERS, mode_rows(result.aggregates)),
        "## Per sample (token reuse · 1st-token agreement; pools and prefixes fill first)",
        markdown_table(*sample_rows(result.records)),
        *decision_lines(result.aggregates),
        *capacity_lines(result),
        f"Wall time {result.wall_s:.0f} s.",
    ]) + "\n"  # fmt: skip


def capacity_warning(result: BenchResult) -> str | None:
    """One sentence naming the modes whose store namespace evicted or refused segments."""
    losses = result.capacity_losses()
    if not losses:
        return None
    modes = ", ".join(f"{m} ({e} evicted, {r} refused)" for m, (e, r) in losses.items())
    return (
        f"The store lost segments during the run: {modes}. Those modes' reuse and speedup are "
        f"understated; rerun with a larger --store-memory-mib (this run: "
        f"{result.config.store_memory_mib})."
    )


def capacity_lines(result: BenchResult) -> list[str]:
    warning = capacity_warning(result)
    return [] if warning is None else ["## Store capacity", f"**{warning}**"]


def decision_lines(aggregates: Aggregates) -> list[str]:
    """A section listing each mode's policy decisions (gate reasons, acceptance verdicts)."""
    rows = [f"- {g.mode}: " + ", ".join(f"{k} ×{n}" for k, n in g.decision_counts.items())
            for g in aggregates.by_mode if g.decision_counts]  # fmt: skip
    return ["## Policy decisions (calls)", "\n".join(rows)] if rows else []


def _policy_source(path: Path | None, admission: AdmissionPolicy | None) -> str:
    if path is not None:
        return f"admission policy `{path}`"
    return "the built-in defaults" if admission is None else "a given admission policy"


def write_json(path: Path, payload: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def write_bench_files(result: BenchResult, out_dir: Path) -> dict[str, Path]:
    """results.json, results.md and the PNG plots in `out_dir`; name → path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"json": write_json(out_dir / RESULTS_JSON, result.to_dict())}
    files["markdown"] = out_dir / RESULTS_MD
    files["markdown"].write_text(results_markdown(result), encoding="utf-8")
    files.update(write_plots(result.aggregates, out_dir, title=result.config.workload))
    logger.info("wrote %s", ", ".join(str(p) for p in files.values()))
    return files


def rich_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    table = Table(*headers, title=title)
    for row in rows:
        table.add_row(*row)
    return table


def render_bench_agents(result: BenchResult) -> list[RenderableType]:
    """The CLI's view of a run: the two tables, then where the files are."""
    files = "\n".join(f"  {name}: {path}" for name, path in result.files.items())
    return [
        rich_table(f"TTFT per agent: {result.config.workload}", POSITION_HEADERS,
                   position_rows(result.aggregates, result.records)),
        rich_table("Fidelity per mode (vs dense prefill of the same prompt)", MODE_HEADERS,
                   mode_rows(result.aggregates)),
        *([] if (warning := capacity_warning(result)) is None else [Text(warning, style="bold yellow")]),
        Text(f"wall time {result.wall_s:.0f} s; files:\n{files}"),
    ]  # fmt: skip
