"""PNG charts of a run's aggregates: TTFT per agent, speedup vs reuse rate, fidelity per mode.

Owns the figures only. It draws on `matplotlib.figure.Figure` with the Agg
canvas directly, so it never touches pyplot's global backend or state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvsplice.eval.metrics import Aggregates, GroupStats

logger = logging.getLogger(__name__)

TTFT_PNG = "ttft_per_agent.png"
SPEEDUP_PNG = "speedup_vs_reuse.png"
FIDELITY_PNG = "fidelity_per_mode.png"
DPI = 120


def _modes(groups: Sequence[GroupStats]) -> list[str]:
    return list(dict.fromkeys(g.mode for g in groups))


def _save(figure: Figure, path: Path) -> Path:
    FigureCanvasAgg(figure)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    return path


def plot_ttft(aggregates: Aggregates, path: Path, title: str = "") -> Path:
    """Grouped bars: median TTFT (ms) per agent position, one bar per mode."""
    groups = aggregates.by_position
    positions = sorted({g.position for g in groups if g.position is not None})
    modes = _modes(groups)
    figure = Figure(figsize=(1.6 + 1.2 * len(positions), 4.0))
    axes = figure.add_subplot()
    width = 0.8 / max(len(modes), 1)
    for index, mode in enumerate(modes):
        by_position = {g.position: g.median_ttft_s * 1000 for g in groups if g.mode == mode}
        xs = [p + (index - (len(modes) - 1) / 2) * width for p in positions]
        axes.bar(xs, [by_position.get(p, 0.0) for p in positions], width, label=mode)
    axes.set_xticks(positions, [f"agent {p}" for p in positions])
    axes.set_ylabel("median TTFT (ms)")
    axes.set_title(f"TTFT per agent {title}".strip())
    axes.legend()
    return _save(figure, path)


def plot_speedup_vs_reuse(aggregates: Aggregates, path: Path, title: str = "") -> Path:
    """One point per (mode, agent position): token reuse rate vs TTFT speedup over dense."""
    figure = Figure(figsize=(5.5, 4.0))
    axes = figure.add_subplot()
    for mode in _modes(aggregates.by_position):
        points = [g for g in aggregates.by_position if g.mode == mode and g.speedup is not None]
        axes.scatter(
            [100 * g.token_reuse_rate for g in points], [g.speedup for g in points], label=mode
        )
        for g in points:
            axes.annotate(str(g.position), (100 * g.token_reuse_rate, g.speedup), fontsize=8,
                          xytext=(3, 3), textcoords="offset points")  # fmt: skip
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes.set_xlabel("token reuse rate (%)")
    axes.set_ylabel("TTFT speedup vs dense (x)")
    axes.set_title(f"Speedup vs reuse (label = agent) {title}".strip())
    axes.legend()
    return _save(figure, path)


def plot_fidelity(aggregates: Aggregates, path: Path, title: str = "") -> Path:
    """Per mode: first-token agreement and output match (%), and mean/max KL(dense ‖ mode)."""
    groups = list(aggregates.by_mode)
    xs = list(range(len(groups)))
    figure = Figure(figsize=(4.0 + 1.2 * len(groups), 4.0))
    rates, kls = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    for offset, label, values in (
        (-0.2, "first-token agreement", [g.first_token_agreement for g in groups]),
        (0.2, "output match", [g.output_match for g in groups]),
    ):
        rates.bar([x + offset for x in xs], [100 * (v or 0.0) for v in values], 0.4, label=label)
    rates.set_xticks(xs, [g.mode for g in groups])
    rates.set_ylim(0, 105)
    rates.set_ylabel("% of calls")
    rates.legend(fontsize=8)
    kls.bar([x - 0.2 for x in xs], [g.mean_kl or 0.0 for g in groups], 0.4, label="mean KL")
    kls.bar([x + 0.2 for x in xs], [g.max_kl or 0.0 for g in groups], 0.4, label="max KL")
    kls.set_xticks(xs, [g.mode for g in groups])
    kls.set_ylabel("KL(dense ‖ mode), nats")
    kls.legend(fontsize=8)
    figure.suptitle(f"Fidelity vs dense {title}".strip())
    return _save(figure, path)


def write_plots(aggregates: Aggregates, out_dir: Path, title: str = "") -> dict[str, Path]:
    """All three charts into `out_dir`; name → path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {
        "ttft_plot": plot_ttft(aggregates, out_dir / TTFT_PNG, title),
        "speedup_plot": plot_speedup_vs_reuse(aggregates, out_dir / SPEEDUP_PNG, title),
        "fidelity_plot": plot_fidelity(aggregates, out_dir / FIDELITY_PNG, title),
    }
