"""Report, plot and demo-table writers on hand-built records: files exist, JSON has its schema."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from helpers.evaluation import make_record
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.console import Console

from kvsplice.client.modes.admission import AdmissionPolicy
from kvsplice.client.modes.blend import Params as BlendParams
from kvsplice.common.namespace_stats import NamespaceStats
from kvsplice.eval.bench.agents.config import BenchAgentsConfig
from kvsplice.eval.bench.agents.report import (
    RESULTS_JSON,
    RESULTS_MD,
    render_bench_agents,
    results_markdown,
    write_bench_files,
)
from kvsplice.eval.bench.agents.result import BenchResult
from kvsplice.eval.bench.demo.bench import DemoResult, agent_rows, demo_json, render_demo
from kvsplice.eval.bench.demo.config import DemoConfig
from kvsplice.eval.measure.metrics import aggregate
from kvsplice.eval.report.plots import (
    KL_FLOOR_NATS,
    fidelity_points,
    place_legend,
    plot_ttft,
    series_color,
    series_marker,
    write_plots,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("ttft_plot", "speedup_plot", "fidelity_plot", "speedup_fidelity_plot")
FINGERPRINT = "kvfp1-" + "ab" * 16


# per mode: TTFT scale, reused tokens, reused spans (naive: 30 of its 90 tokens at half depth)
MODES = {
    "dense": (2.0, 0, ()),
    "exact": (1.0, 40, ({"num_tokens": 40, "num_layers": 30},)),
    "naive": (0.5, 90, ({"num_tokens": 60, "num_layers": 30}, {"num_tokens": 30, "num_layers": 15})),
}  # fmt: skip


def make_records() -> list:
    records = []
    for mode, (ttft_s, reused, spans) in MODES.items():
        for position in (1, 2, 3):
            fidelity = {
                "first_token_agrees": True,
                "kl_dense_reuse": 0.0 if mode != "naive" else 0.4,
                "output_matches": mode != "naive",
            }
            records.append(make_record(mode=mode, position=position, agent_id=str(position),
                                       agent_name=f"role{position}", ttft_s=ttft_s * position,
                                       num_reused_tokens=reused, correct=(mode != "naive") if position == 3 else None,
                                       num_layers=30, reused_spans=spans, **fidelity))  # fmt: skip
    return records


def make_bench_result(out_dir: Path, **config_overrides: object) -> BenchResult:
    records = make_records()
    config = BenchAgentsConfig(workload="math", samples=1, out_dir=out_dir, **config_overrides)
    return BenchResult(
        config,
        {"cpu": "test cpu", "torch": "x"},
        records,
        aggregate(records),
        1.5,
        {"exact": "ns-exact"},
    )


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """One set of bench files (matplotlib is the slow part, so it draws once)."""
    out_dir = tmp_path_factory.mktemp("bench")
    return out_dir, write_bench_files(make_bench_result(out_dir), out_dir)


def test_bench_files_exist_with_the_json_schema(written: tuple[Path, dict[str, Path]]) -> None:
    tmp_path, files = written
    assert set(files) == {"json", "markdown", *PLOTS}
    data = json.loads((tmp_path / RESULTS_JSON).read_text())
    assert set(data) == {
        "config", "environment", "wall_s", "namespaces", "store_stats", "aggregates", "records",
    }  # fmt: skip
    assert set(data["aggregates"]) == {"by_position", "by_mode"}
    assert len(data["records"]) == 9 and "first_token_logits" not in data["records"][0]
    assert data["config"]["workload"] == "math" and data["config"]["modes"] == [
        "dense",
        "exact",
        "naive",
    ]
    naive = next(g for g in data["aggregates"]["by_mode"] if g["mode"] == "naive")
    assert naive["speedup"] == pytest.approx(4.0)
    assert naive["token_layer_reuse_rate"] == pytest.approx((60 * 30 + 30 * 15) / (100 * 30))
    assert data["config"]["policy_path"] is None and data["config"]["admission"] is None
    for name in PLOTS:
        assert files[name].read_bytes()[:8] == PNG_MAGIC


def test_markdown_has_both_tables(written: tuple[Path, dict[str, Path]]) -> None:
    text = (written[0] / RESULTS_MD).read_text()
    assert "## TTFT per agent and mode" in text and "## Fidelity per mode" in text
    assert (
        "| agent | mode | calls | prompt tok | mean TTFT ms | median TTFT ms | speedup | token reuse | token·layer reuse | calls reusing |"
        in text
    )
    assert "| 2 role2 | exact | 1 | 100 | 2000.0 | 2000.0 | 2.00x | 40% | 40% | 100% |" in text
    assert "| 3 role3 | naive | 1 | 100 | 1500.0 | 1500.0 | 4.00x | 90% | 75% | 100% |" in text
    assert (
        "| naive | 3 | 4.00x | 90% | 75% | 100% | 100% | 4.00e-01 | 4.00e-01 | 0% | 0.0% of 1 | -100.0 pt |"
        in text
    )
    assert "| dense | 3 | 1.00x |" in text and "| 100.0% of 1 | - |" in text
    assert "Variant parameters from the built-in defaults." in text  # fmt: skip


def test_render_bench_agents_prints(tmp_path: Path) -> None:
    result = make_bench_result(tmp_path)
    console = Console(file=io.StringIO(), width=250)
    for renderable in render_bench_agents(result):
        console.print(renderable)
    output = console.file.getvalue()
    assert "Fidelity per mode" in output and output.count("token·layer reuse") == 2
    assert "75%" in output


def test_the_policy_file_and_its_parameters_are_recorded(tmp_path: Path) -> None:
    admission = AdmissionPolicy(FINGERPRINT, params={"blend": BlendParams(ratio=0.3)})
    result = make_bench_result(tmp_path, admission=admission, policy_path="cal/policy.json")
    assert result.config.modes == ("dense", "exact", "naive")
    data = json.loads(json.dumps(result.to_dict(), default=str))
    assert data["config"]["policy_path"] == "cal/policy.json"
    assert data["config"]["admission"]["params"]["blend"]["ratio"] == 0.3
    assert "Variant parameters from admission policy `cal/policy.json`." in results_markdown(result)
    with pytest.raises(ValueError, match="policy_path"):
        BenchAgentsConfig(policy_path=Path("policy.json"))


def test_bench_config_keeps_modes_as_labels_dense_first() -> None:
    config = BenchAgentsConfig(modes=("halo:eps=0.05+h=4", "dense", "blend:r=.5"))
    assert config.modes == ("dense", "halo:h=4+eps=0.05", "blend:r=0.5")
    with pytest.raises(ValueError, match="bad value"):
        BenchAgentsConfig(modes=("dense", "blend:r=lots"))


def test_plots_cope_with_missing_fidelity(tmp_path: Path) -> None:
    records = [make_record(), make_record(mode="naive", ttft_s=0.5)]
    files = write_plots(aggregate(records), tmp_path)
    assert all(path.read_bytes()[:8] == PNG_MAGIC for path in files.values())
    assert [(p.kl_x, p.agreement_pct) for p in fidelity_points(aggregate(records))] == [
        (None, None),
        (None, None),
    ]


def test_a_chart_goes_into_a_directory_that_does_not_exist_yet(tmp_path: Path) -> None:
    """`kvsplice demo --store` in a fresh container: no results/demo until the chart is saved."""
    path = tmp_path / "results" / "demo" / "ttft_per_agent.png"
    plot_ttft(aggregate([make_record(), make_record(mode="naive", ttft_s=0.5)]), path)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_fidelity_points_put_kl_zero_on_the_log_floor() -> None:
    points = fidelity_points(aggregate(make_records()))
    assert [p.label for p in points] == ["dense", "exact", "naive"]
    assert [p.kl_x for p in points] == [KL_FLOOR_NATS, KL_FLOOR_NATS, pytest.approx(0.4)]
    assert [p.speedup for p in points] == [1.0, 2.0, 4.0]
    assert {p.agreement_pct for p in points} == {100.0}


def make_many_variants() -> list:
    records = [make_record(position=p, ttft_s=2.0 * p) for p in (1, 2)]
    for index in range(9):
        label = f"blend:r=0.{index + 1}"
        records += [
            make_record(mode=label, position=p, ttft_s=(1.0 + 0.1 * index) * p, num_layers=30,
                        num_reused_tokens=50, reused_spans=({"num_tokens": 50, "num_layers": 27},),
                        first_token_agrees=index % 2 == 0, kl_dense_reuse=0.01 * index)
            for p in (1, 2)
        ]  # fmt: skip
    return records


def test_plots_with_ten_variants_keep_the_legend_beside_the_axes(tmp_path: Path) -> None:
    files = write_plots(aggregate(make_many_variants()), tmp_path)
    assert set(files) == set(PLOTS)
    assert all(path.read_bytes()[:8] == PNG_MAGIC for path in files.values())
    figure = Figure()
    axes = figure.add_subplot()
    for index in range(10):
        axes.bar([index], [1.0], label=f"halo:h={index}+eps=0.05")
    place_legend(axes, 10)
    renderer = FigureCanvasAgg(figure).get_renderer()
    legend = axes.get_legend()
    assert legend is not None
    assert legend.get_window_extent(renderer).x0 >= axes.get_window_extent(renderer).x1


def test_demo_rows_and_render(tmp_path: Path) -> None:
    records = make_records()
    aggregates = aggregate(records)
    rows = agent_rows(aggregates, records, ("dense", "exact", "naive"))
    assert [r.label for r in rows] == ["1 role1", "2 role2", "3 role3"]
    assert rows[2].dense_ttft_s == 6.0 and rows[2].speedup["naive"] == pytest.approx(4.0)
    assert rows[0].reuse_rate["exact"] == pytest.approx(0.4)
    result = DemoResult(
        config=DemoConfig(out_dir=tmp_path), rows=rows, aggregates=aggregates, records=records,
        wall_s=3.0, namespaces={"exact": "demo-x-exact", "naive": "demo-x-naive"},
        store_stats={"demo-x-exact": NamespaceStats(
            num_segments=4, num_bytes=12_288, num_hits=2, num_misses=1, num_evictions=0,
            num_refused_puts=0, num_calls=3, num_prompt_tokens=300,
            hit_tokens={"local": 100, "in_place": 0, "grpc": 20},
        ), "demo-x-naive": None},
        stats_hints=["http://127.0.0.1:1/v1/stats?namespace=demo-x-exact"],
        json_path=tmp_path / "demo.json", chart_path=tmp_path / "c.png",
    )  # fmt: skip
    console = Console(file=io.StringIO(), width=100)  # a normal terminal: nothing is cut
    for renderable in render_demo(result):
        console.print(renderable)
    output = console.file.getvalue()
    assert "v1/stats?namespace=demo-x-exact" in output and "4.00x" in output
    assert "…" not in output and max(len(line) for line in output.splitlines()) <= 100
    assert "12.0 KiB" in output and "120 / 300" in output and "100 / 0 / 20" in output
    data = json.loads(json.dumps(demo_json(result), default=str))
    assert {"config", "agents", "aggregates", "records", "store_stats"} <= set(data)


def test_a_mode_keeps_its_colour_in_every_figure_and_variants_shade_it() -> None:
    labels = ["dense", "exact", "blend:r=0.2", "blend:r=0.4"]
    assert series_color("exact", labels) == series_color("exact", ["exact"])
    assert series_color("blend:r=0.2", labels) == series_color("blend:r=0.2", ["blend:r=0.2"])
    assert series_color("blend:r=0.4", labels) != series_color("blend:r=0.2", labels)
    assert series_marker("blend:r=0.4", labels) != series_marker("blend:r=0.2", labels)
    assert len({series_color(label, labels) for label in labels}) == len(labels)


def test_speedup_vs_fidelity_has_a_legend_no_point_labels_the_region_and_n(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvsplice.eval.report.plots as plots

    figures: list[Figure] = []
    real_save = plots._save
    monkeypatch.setattr(plots, "_save", lambda f, p: (figures.append(f), real_save(f, p))[1])
    plots.plot_speedup_vs_fidelity(aggregate(make_many_variants()), tmp_path / "s.png")
    (figure,) = figures
    kls, agreements = figure.axes
    assert not kls.texts and not agreements.texts  # no labels beside points to collide
    legend = [t.get_text() for t in kls.get_legend().get_texts()]
    assert legend[0] == "admitted: KL ≤ 0.05"
    assert {f"blend:r=0.{i + 1}" for i in range(9)} <= set(legend)
    assert [t.get_text() for t in agreements.get_legend().get_texts()] == [
        "admitted: agreement ≥ 95%"
    ]
    assert "N = 2 calls per variant" in figure._suptitle.get_text()
