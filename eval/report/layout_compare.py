"""Prompt layouts side by side: what each buys (exact reuse, speedup) and what it costs.

Owns `LayoutRow`, `compare_layouts` and the files `layouts.md` / `layouts.json`
that `bench agents --layout a,b,c` writes beside each layout's own results. A
layout changes the prompts, so every figure of a row is measured against dense
prefill of that layout; what a layout does to the answers themselves is shown
by dense's task accuracy and by how often its dense final answer equals the
first layout's on the same problem. Running the benches is `bench_agents`'.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvsplice.common.reuse_modes import DENSE
from kvsplice.eval.measure.metrics import Aggregates, CallRecord, GroupStats
from kvsplice.eval.report.results import fmt_pct, fmt_x, write_json

logger = logging.getLogger(__name__)

LAYOUTS_JSON = "layouts.json"
LAYOUTS_MD = "layouts.md"
HEADERS = (
    "layout", "mode", "prompt tok (agent 1→N)", "token reuse", "speedup",
    "speedup per agent", "output match", "dense accuracy", "dense answer = first layout's",
)  # fmt: skip


@dataclass(frozen=True)
class LayoutRow:
    """One (layout, reuse mode) pair: reuse, speedup and fidelity, vs dense of that layout."""

    layout: str
    mode: str
    mean_prompt_tokens: tuple[float, ...]
    token_reuse_rate: float
    speedup: float | None
    speedup_by_position: tuple[float | None, ...]
    output_match: float | None
    dense_accuracy: float | None
    dense_final_same_as_first_layout: float | None


def compare_layouts(runs: Sequence[tuple[str, Aggregates, list[CallRecord]]]) -> list[LayoutRow]:
    """One row per (layout, non-dense mode) of `runs`, in order; the first layout is the base."""
    base_finals = _dense_finals(runs[0][2]) if runs else {}
    rows = []
    for layout, aggregates, records in runs:
        finals = _dense_finals(records)
        same = [finals[p] == base_finals[p] for p in finals if p in base_finals]
        dense = aggregates.at(DENSE)
        for stats in aggregates.by_mode:
            if stats.mode == DENSE:
                continue
            positions = sorted({r.position for r in records if r.mode == stats.mode})
            rows.append(LayoutRow(
                layout=layout, mode=stats.mode,
                mean_prompt_tokens=tuple(_at(aggregates, stats.mode, p).mean_prompt_tokens for p in positions),
                token_reuse_rate=stats.token_reuse_rate, speedup=stats.speedup,
                speedup_by_position=tuple(_at(aggregates, stats.mode, p).speedup for p in positions),
                output_match=stats.output_match,
                dense_accuracy=None if dense is None else dense.accuracy,
                dense_final_same_as_first_layout=sum(same) / len(same) if same else None,
            ))  # fmt: skip
    return rows


def write_layout_files(rows: Sequence[LayoutRow], out_dir: Path) -> dict[str, Path]:
    """layouts.json and layouts.md in `out_dir`; name → path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"layouts_json": write_json(out_dir / LAYOUTS_JSON, [asdict(r) for r in rows])}
    files["layouts_markdown"] = out_dir / LAYOUTS_MD
    files["layouts_markdown"].write_text(layouts_markdown(rows), encoding="utf-8")
    return files


def layouts_markdown(rows: Sequence[LayoutRow]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(layout_cells(row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def layout_cells(row: LayoutRow) -> list[str]:
    return [
        row.layout, row.mode, " / ".join(f"{n:.0f}" for n in row.mean_prompt_tokens),
        fmt_pct(row.token_reuse_rate), fmt_x(row.speedup),
        " / ".join("-" if s is None else f"{s:.1f}" for s in row.speedup_by_position),
        fmt_pct(row.output_match), fmt_pct(row.dense_accuracy),
        fmt_pct(row.dense_final_same_as_first_layout),
    ]  # fmt: skip


def _dense_finals(records: Sequence[CallRecord]) -> dict[str, str]:
    """Problem id → the dense pipeline's final answer text."""
    last = max((r.position for r in records), default=0)
    return {r.problem_id: r.output_text for r in records if r.mode == DENSE and r.position == last}


def _at(aggregates: Aggregates, mode: str, position: int) -> GroupStats:
    stats = aggregates.at(mode, position)
    assert stats is not None  # `position` comes from this mode's own records
    return stats
