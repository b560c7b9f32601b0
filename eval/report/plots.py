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

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure

from kvsplice.eval.measure.metrics import Aggregates, GroupStats

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
# One colour per mode in every figure of every run; a mode's variants are lighter shades of
# it (bars) or other markers (points), in the order the run lists them.
MODE_COLORS = {
    "dense": "#4d4d4d", "exact": "#1f77b4", "naive": "#d62728", "blend": "#2ca02c",
    "halo": "#9467bd", "anchor": "#ff7f0e", "multicut": "#17becf",
}  # fmt: skip
OTHER_COLOR = "#8c564b"
MARKERS = "osD^vP*Xhp<>"
# The calibration defaults (eval.calibrate.Thresholds): the region a variant must reach.
ADMIT_MAX_MEAN_KL = 0.05
ADMIT_MIN_AGREEMENT = 0.95


def _modes(groups: Sequence[GroupStats]) -> list[str]:
    return list(dict.fromkeys(g.mode for g in groups))


def mode_of(label: str) -> str:
    """'blend:r=0.4' -> 'blend'."""
    return label.split(":", 1)[0]


def _variant_index(label: str, labels: Sequence[str]) -> tuple[int, int]:
    """(index of `label` among the variants of its mode in `labels`, how many there are)."""
    siblings = [x for x in dict.fromkeys(labels) if mode_of(x) == mode_of(label)]
    return siblings.index(label), len(siblings)


def series_color(label: str, labels: Sequence[str] = ()) -> tuple[float, float, float]:
    """The mode's colour; later variants of the same mode are lighter shades of it."""
    base = to_rgb(MODE_COLORS.get(mode_of(label), OTHER_COLOR))
    index, count = _variant_index(label, labels) if label in labels else (0, 1)
    mix = 0.6 * index / max(count, 2)
    red, green, blue = (c + (1.0 - c) * mix for c in base)
    return red, green, blue


def series_marker(label: str, labels: Sequence[str] = ()) -> str:
    index, _ = _variant_index(label, labels) if label in labels else (0, 1)
    return MARKERS[index % len(MARKERS)]


def _calls_note(groups: Sequence[GroupStats]) -> str:
    """'N = 12 calls per variant' (or a range when variants differ)."""
    counts = sorted({g.num_calls for g in groups})
    if not counts:
        return ""
    n = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"N = {n} calls per variant"


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
    for index, mode in enumerate(modes):
        by_position = {g.position: g.median_ttft_s * 1000 for g in groups if g.mode == mode}
        xs = [p + (index - (len(modes) - 1) / 2) * width for p in positions]
        axes.bar(xs, [by_position.get(p, 0.0) for p in positions], width, label=mode,
                 color=series_color(mode, modes), edgecolor="white", linewidth=0.5)  # fmt: skip
    axes.set_xticks(positions, [f"agent {p}" for p in positions])
    axes.set_ylabel("median TTFT (ms)")
    per_agent = [g for g in groups if g.position is not None]
    note = _calls_note(per_agent).replace("per variant", "per variant and agent")
    axes.set_title(f"TTFT per agent {title}\n{note}".strip(), fontsize=10)
    place_legend(axes, len(modes))
    return _save(figure, path)


def plot_speedup_vs_reuse(aggregates: Aggregates, path: Path, title: str = "") -> Path:
    """One point per (mode, agent position): token reuse rate vs TTFT speedup over dense."""
    figure = Figure(figsize=(5.5, 4.0))
    axes = figure.add_subplot()
    modes = _modes(aggregates.by_position)
    for mode in modes:
        points = [(g.position, 100 * g.token_reuse_rate, speedup) for g in aggregates.by_position
                  if g.mode == mode and (speedup := g.speedup) is not None]  # fmt: skip
        axes.scatter([x for _, x, _ in points], [y for _, _, y in points], label=mode,
                     color=series_color(mode, modes), marker=series_marker(mode, modes))  # fmt: skip
        for position, x, y in points:
            axes.annotate(str(position), (x, y), fontsize=8,
                          xytext=(3, 3), textcoords="offset points")  # fmt: skip
    axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    axes.set_xlabel("token reuse rate (%)")
    axes.set_ylabel("TTFT speedup vs dense (x)")
    note = _calls_note(aggregates.by_position).replace("per variant", "per point")
    axes.set_title(f"Speedup vs reuse (label = agent) {title}\n{note}".strip(), fontsize=10)
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


def plot_speedup_vs_fidelity(
    aggregates: Aggregates,
    path: Path,
    title: str = "",
    max_mean_kl: float = ADMIT_MAX_MEAN_KL,
    min_agreement: float = ADMIT_MIN_AGREEMENT,
) -> Path:
    """One point per variant: pipeline TTFT speedup vs mean KL(dense ‖ mode) and vs agreement.

    Variants are told apart by the legend (colour per mode, marker per variant), never by
    text next to the points, which collides where points cluster. The admission region of
    the calibration thresholds is shaded on both panels.
    """
    points = fidelity_points(aggregates)
    labels = [p.label for p in points]
    figure = Figure(figsize=(11.0, 4.8))
    kls = figure.add_subplot(1, 2, 1)
    agreements = figure.add_subplot(1, 2, 2, sharey=kls)
    kls.axvspan(KL_FLOOR_NATS / 3, max_mean_kl, color="#2ca02c", alpha=0.08, linewidth=0,
                label=f"admitted: KL ≤ {max_mean_kl:g}")  # fmt: skip
    agreements.axvspan(100 * min_agreement, 102, color="#2ca02c", alpha=0.08, linewidth=0,
                       label=f"admitted: agreement ≥ {100 * min_agreement:g}%")  # fmt: skip
    for point in points:
        color, marker = series_color(point.label, labels), series_marker(point.label, labels)
        for panel, x in ((kls, point.kl_x), (agreements, point.agreement_pct)):
            if x is not None:
                panel.scatter([x], [point.speedup], color=color, marker=marker, s=42,
                              label=point.label)  # fmt: skip
    kls.set_xscale("log")
    kls.set_xlim(KL_FLOOR_NATS / 3, None)
    floored = any(p.kl_x == KL_FLOOR_NATS for p in points)
    note = f"; KL 0 drawn at {KL_FLOOR_NATS:g}" if floored else ""
    kls.set_xlabel(f"mean KL(dense ‖ mode), nats, log{note}")
    agreements.set_xlabel("first-token agreement with dense (%)")
    rates = [p.agreement_pct for p in points if p.agreement_pct is not None]
    agreements.set_xlim(min([*rates, 100 * min_agreement - 5]) - 5, 102)
    for axes in (kls, agreements):
        axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        axes.set_ylabel("pipeline TTFT speedup vs dense (x)")
    handles, names = agreements.get_legend_handles_labels()
    agreements.legend(handles[:1], names[:1], fontsize=7, loc="lower left")
    place_legend(kls, len(points) + 1)
    calls = _calls_note(aggregates.by_mode)
    figure.suptitle(f"Speedup vs fidelity per variant {title} ({calls})".strip())
    return _save(figure, path)


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
