"""PNG charts of a run's aggregates: TTFT per agent, speedup vs reuse and vs fidelity, fidelity.

Owns the figures only; one series per mode variant. It draws on
`matplotlib.figure.Figure` with the Agg canvas directly, so it never touches
pyplot's global backend or state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvsplice.eval.metrics import Aggregates, GroupStats

logger = logging.getLogger(__name__)

TTFT_PNG = "ttft_per_agent.png"
SPEEDUP_PNG = "speedup_vs_reuse.png"
FIDELITY_PNG = "fidelity_per_mode.png"
SPEEDUP_FIDELITY_PNG = "speedup_vs_fidelity.png"
DPI = 120
# KL 0 (dense, exact) has no place on a log axis: such points sit at this floor.
KL_FLOOR_NATS = 1e-6
# Up to this many series the legend fits inside the axes; more go beside them.
MAX_INNER_LEGEND = 4


def _modes(groups: Sequence[GroupStats]) -> list[str]:
    return list(dict.fromkeys(g.mode for g in groups))


def _colors(num_series: int) -> list[tuple[float, ...]]:
    """Distinct colors for up to 20 series (tab10, then tab20), repeating past that."""
    cmap = colormaps["tab10" if num_series <= 10 else "tab20"]
    return [cmap(index % cmap.N) for index in range(num_series)]


def place_legend(axes: Axes, num_series: int) -> None:
    """A legend inside the axes for a few series, beside them for more."""
    if num_series <= MAX_INNER_LEGEND:
        axes.legend(fontsize=8)
    else:  # beside the axes, so many variants never cover the data
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)  # a fresh container has no results/ yet
    FigureCanvasAgg(figure)
    figure.tight_layout()
    figure.savefig(path, dpi=DPI, bbox_inches="tight")
    return path


def plot_ttft(aggregates: Aggregates, path: Path, title: str = "") -> Path:
    """Grouped bars: median TTFT (ms) per agent position, one bar per mode."""
    groups = aggregates.by_position
    positions = sorted({g.position for g in groups if g.position is not None})
    modes = _modes(groups)
    figure = Figure(figsize=(1.6 + (0.8 + 0.15 * len(modes)) * len(positions), 4.0))
    axes = figure.add_subplot()
    width = 0.8 / max(len(modes), 1)
    for index, (mode, color) in enumerate(zip(modes, _colors(len(modes)), strict=True)):
        by_position = {g.position: g.median_ttft_s * 1000 for g in groups if g.mode == mode}
        xs = [p + (index - (len(modes) - 1) / 2) * width for p in positions]
        axes.bar(xs, [by_position.get(p, 0.0) for p in positions], width, label=mode, color=color)
    axes.set_xticks(positions, [f"agent {p}" for p in positions])
    axes.set_ylabel("median TTFT (ms)")
    axes.set_title(f"TTFT per agent {title}".strip())
    place_legend(axes, len(modes))
    return _save(figure, path)


def plot_speedup_vs_reuse(aggregates: Aggregates, path: Path, title: str = "") -> Path:
    """One point per (mode, agent position): token reuse rate vs TTFT speedup over dense."""
    figure = Figure(figsize=(5.5, 4.0))
    axes = figure.add_subplot()
    modes = _modes(aggregates.by_position)
    for mode, color in zip(modes, _colors(len(modes)), strict=True):
        points = [g for g in aggregates.by_position if g.mode == mode and g.speedup is not None]
        xs = [100 * g.token_reuse_rate for g in points]
        axes.scatter(xs, [g.speedup for g in points], label=mode, color=color)
        for g in points:
            axes.annotate(str(g.position), (100 * g.token_reuse_rate, g.speedup), fontsize=8,
                          xytext=(3, 3), textcoords="offset points")  # fmt: skip
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes.set_xlabel("token reuse rate (%)")
    axes.set_ylabel("TTFT speedup vs dense (x)")
    axes.set_title(f"Speedup vs reuse (label = agent) {title}".strip())
    place_legend(axes, len(modes))
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
    _mode_ticks(rates, [g.mode for g in groups])
    rates.set_ylim(0, 105)
    rates.set_ylabel("% of calls")
    _legend_above(rates)
    kls.bar([x - 0.2 for x in xs], [g.mean_kl or 0.0 for g in groups], 0.4, label="mean KL")
    kls.bar([x + 0.2 for x in xs], [g.max_kl or 0.0 for g in groups], 0.4, label="max KL")
    _mode_ticks(kls, [g.mode for g in groups])
    kls.set_ylabel("KL(dense ‖ mode), nats")
    _legend_above(kls)
    figure.suptitle(f"Fidelity vs dense {title}".strip())
    return _save(figure, path)


def _legend_above(axes: Axes) -> None:
    # Above the axes: inside, it would cover the bars of some variant at 100% or max KL.
    axes.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)


def _mode_ticks(axes: Axes, labels: Sequence[str]) -> None:
    """Variant labels under bars; slanted once there are many or they are long."""
    slanted = len(labels) > MAX_INNER_LEGEND or max(map(len, labels), default=0) > 8
    axes.set_xticks(range(len(labels)), labels, rotation=35 if slanted else 0,
                    ha="right" if slanted else "center", fontsize=8)  # fmt: skip


@dataclass(frozen=True)
class FidelityPoint:
    """One variant on the speedup-vs-fidelity chart; `kl_x`: mean KL raised to the log floor."""

    label: str
    speedup: float
    kl_x: float | None
    agreement_pct: float | None


def fidelity_points(aggregates: Aggregates) -> list[FidelityPoint]:
    """Per variant with a speedup: where it sits on the two panels (None: not measured)."""
    return [
        FidelityPoint(
            g.mode,
            g.speedup,
            None if g.mean_kl is None else max(g.mean_kl, KL_FLOOR_NATS),
            None if g.first_token_agreement is None else 100 * g.first_token_agreement,
        )
        for g in aggregates.by_mode
        if g.speedup is not None
    ]


def plot_speedup_vs_fidelity(aggregates: Aggregates, path: Path, title: str = "") -> Path:
    """One point per variant: pipeline TTFT speedup vs mean KL(dense ‖ mode) and vs agreement."""
    points = fidelity_points(aggregates)
    figure = Figure(figsize=(10.0, 4.5))
    kls = figure.add_subplot(1, 2, 1)
    agreements = figure.add_subplot(1, 2, 2, sharey=kls)
    for point, color in zip(points, _colors(len(points)), strict=True):
        if point.kl_x is not None:
            _labelled_point(kls, point.kl_x, point.speedup, point.label, color)
        if point.agreement_pct is not None:
            _labelled_point(agreements, point.agreement_pct, point.speedup, point.label, color)
    kls.set_xscale("log")
    floored = any(p.kl_x == KL_FLOOR_NATS for p in points)
    note = f"; KL 0 drawn at {KL_FLOOR_NATS:g}" if floored else ""
    kls.set_xlabel(f"mean KL(dense ‖ mode), nats, log{note}")
    agreements.set_xlabel("first-token agreement with dense (%)")
    rates = [p.agreement_pct for p in points if p.agreement_pct is not None]
    agreements.set_xlim(min([*rates, 90.0]) - 5, 102)
    for axes in (kls, agreements):
        axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        axes.set_ylabel("pipeline TTFT speedup vs dense (x)")
    figure.suptitle(f"Speedup vs fidelity per variant {title}".strip())
    return _save(figure, path)


def _labelled_point(axes: Axes, x: float, y: float, label: str, color: object) -> None:
    axes.scatter([x], [y], color=color)
    axes.annotate(label, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")


def write_plots(aggregates: Aggregates, out_dir: Path, title: str = "") -> dict[str, Path]:
    """All four charts into `out_dir`; name → path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {
        "ttft_plot": plot_ttft(aggregates, out_dir / TTFT_PNG, title),
        "speedup_plot": plot_speedup_vs_reuse(aggregates, out_dir / SPEEDUP_PNG, title),
        "fidelity_plot": plot_fidelity(aggregates, out_dir / FIDELITY_PNG, title),
        "speedup_fidelity_plot": plot_speedup_vs_fidelity(
            aggregates, out_dir / SPEEDUP_FIDELITY_PNG, title
        ),
    }
