"""PNG figures of a judge bench: JCR vs candidate-block reuse, and the attention diagnostic.

Owns the figures only (Agg canvas, no pyplot state); colours are `plots`' per mode.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from kvsplice.eval.measure.jcr import ModeSummary
from kvsplice.eval.measure.judge_attention import REFERENCE, AttentionProfile
from kvsplice.eval.report.plots import _save, place_legend, series_color, series_marker

logger = logging.getLogger(__name__)

JCR_PNG = "jcr_vs_reuse.png"
ATTENTION_PNG = "attention.png"


def plot_jcr_vs_reuse(summaries: Sequence[ModeSummary], path: Path, title: str = "") -> Path:
    """One point per mode: candidate-block token·layer reuse (x) against JCR (y)."""
    figure = Figure(figsize=(6.4, 4.4))
    axes = figure.add_subplot()
    labels = [s.mode for s in summaries]
    for s in summaries:
        axes.scatter(100 * s.candidate_token_layer_reuse, 100 * s.jcr, s=60, label=s.mode,
                     color=series_color(s.mode, labels), marker=series_marker(s.mode, labels))  # fmt: skip
    axes.axhline(98, color="#999999", linestyle=":", linewidth=1)
    axes.axvline(30, color="#999999", linestyle=":", linewidth=1)
    axes.set_xlim(-3, 103)
    axes.set_ylim(-3, 103)
    axes.set_xlabel("candidate-block token·layers reused (%)")
    axes.set_ylabel("JCR vs dense judge (%)")
    examples = sorted({s.examples for s in summaries})
    axes.set_title(f"{title}\nN = {examples[-1] if examples else 0} examples per mode", fontsize=9)
    place_legend(axes, len(summaries))
    return _save(figure, path)


def plot_attention(profiles: Sequence[AttentionProfile], path: Path, title: str = "") -> Path:
    """Top row: per slot, the decision position's attention mass per layer (one line per
    mode; dense is the reference). Bottom row: per slot, its tokens' mass to earlier slots
    that the mode computed in the judge's context."""
    num_slots = len(profiles[0].regions) - 2
    figure = Figure(figsize=(3.2 * num_slots, 6.4))
    grid = figure.subplots(2, num_slots, squeeze=False, sharex=True)
    labels = [p.mode for p in profiles]
    for profile in profiles:
        style = _style(profile.mode, labels)
        layers = range(len(profile.decision))
        for k in range(num_slots):
            grid[0][k].plot(layers, [row[k + 1] for row in profile.decision], **style)
            grid[1][k].plot(layers, [row[k] for row in profile.cross_block], **style)
    for k in range(num_slots):
        grid[0][k].set_title(f"decision → slot {k + 1}", fontsize=9)
        grid[1][k].set_title(f"slot {k + 1} → earlier slots", fontsize=9)
        grid[1][k].set_xlabel("layer")
    grid[0][0].set_ylabel("attention mass")
    grid[1][0].set_ylabel("attention mass (computed)")
    place_legend(grid[0][num_slots - 1], len(profiles) + 5)
    figure.suptitle(f"{title}\nmean over {profiles[0].num_calls} judge calls", fontsize=10)
    return _save(figure, path)


def _style(mode: str, labels: Sequence[str]) -> dict[str, object]:
    if mode == REFERENCE:
        return {"label": "dense (reference)", "color": "black", "linewidth": 2.2}
    return {"label": mode, "color": series_color(mode, labels), "linewidth": 1.2}


def write_judge_plots(
    summaries: Sequence[ModeSummary],
    profiles: Sequence[AttentionProfile],
    out_dir: Path,
    title: str = "",
) -> dict[str, Path]:
    files = {"jcr plot": plot_jcr_vs_reuse(summaries, out_dir / JCR_PNG, title)}
    if profiles:
        # dense re-runs the reference's computation: the reference line stands for both.
        shown = [p for p in profiles if p.mode != "dense"]
        files["attention plot"] = plot_attention(shown, out_dir / ATTENTION_PNG, title)
    return files
