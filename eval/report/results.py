"""Tables of a run's records and aggregates, as markdown and rich tables for the CLI.

Owns the number formats, the per agent x mode and per-mode rows, the per-sample cells,
the policy-decision lines and the JSON writer. Numbers come from `metrics`; which bench
writes which file is the bench's own (`bench/agents/report`, `bench/judge/report`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from kvsplice.eval.measure.metrics import (
    DENSE,
    Aggregates,
    CallRecord,
    GroupStats,
    SampleStats,
    by_sample,
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


def decision_lines(aggregates: Aggregates) -> list[str]:
    """A section listing each mode's policy decisions (gate reasons, acceptance verdicts)."""
    rows = [f"- {g.mode}: " + ", ".join(f"{k} ×{n}" for k, n in g.decision_counts.items())
            for g in aggregates.by_mode if g.decision_counts]  # fmt: skip
    return ["## Policy decisions (calls)", "\n".join(rows)] if rows else []


def write_json(path: Path, payload: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def rich_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    table = Table(*headers, title=title)
    for row in rows:
        table.add_row(*row)
    return table
