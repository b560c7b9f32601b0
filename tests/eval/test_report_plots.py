"""Report, plot and demo-table writers on hand-built records: files exist, JSON has its schema."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from eval_factories import make_record
from rich.console import Console

from kvsplice.eval.agents_demo import DemoConfig, DemoResult, agent_rows, demo_json, render_demo
from kvsplice.eval.bench_agents import BenchAgentsConfig, BenchResult
from kvsplice.eval.metrics import aggregate
from kvsplice.eval.plots import write_plots
from kvsplice.eval.report import RESULTS_JSON, RESULTS_MD, render_bench_agents, write_bench_files

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_records() -> list:
    records = []
    for mode, ttft_s, reused in (("dense", 2.0, 0), ("exact", 1.0, 40), ("naive", 0.5, 90)):
        for position in (1, 2, 3):
            fidelity = {
                "first_token_agrees": True,
                "kl_dense_reuse": 0.0 if mode != "naive" else 0.4,
                "output_matches": mode != "naive",
            }
            records.append(make_record(mode=mode, position=position, agent_id=str(position),
                                       agent_name=f"role{position}", ttft_s=ttft_s * position,
                                       num_reused_tokens=reused, correct=(position == 3) or None, **fidelity))  # fmt: skip
    return records


def make_bench_result(out_dir: Path) -> BenchResult:
    records = make_records()
    config = BenchAgentsConfig(workload="math", samples=1, out_dir=out_dir)
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
    assert set(files) == {"json", "markdown", "ttft_plot", "speedup_plot", "fidelity_plot"}
    data = json.loads((tmp_path / RESULTS_JSON).read_text())
    assert set(data) == {"config", "environment", "wall_s", "namespaces", "aggregates", "records"}
    assert set(data["aggregates"]) == {"by_position", "by_mode"}
    assert len(data["records"]) == 9 and "first_token_logits" not in data["records"][0]
    assert data["config"]["workload"] == "math" and data["config"]["modes"] == [
        "dense",
        "exact",
        "naive",
    ]
    naive = next(g for g in data["aggregates"]["by_mode"] if g["mode"] == "naive")
    assert naive["speedup"] == pytest.approx(4.0)
    for name in ("ttft_plot", "speedup_plot", "fidelity_plot"):
        assert files[name].read_bytes()[:8] == PNG_MAGIC


def test_markdown_has_both_tables(written: tuple[Path, dict[str, Path]]) -> None:
    text = (written[0] / RESULTS_MD).read_text()
    assert "## TTFT per agent and mode" in text and "## Fidelity per mode" in text
    assert "| 2 role2 | exact | 1 | 100 | 2000.0 | 2000.0 | 2.00x | 40% | 100% |" in text
    assert (
        "| naive | 3 | 4.00x | 90% | 100% | 100% | 4.00e-01 | 4.00e-01 | 0% | 100% of 1 |" in text
    )


def test_render_bench_agents_prints(tmp_path: Path) -> None:
    result = make_bench_result(tmp_path)
    console = Console(file=io.StringIO(), width=200)
    for renderable in render_bench_agents(result):
        console.print(renderable)
    assert "Fidelity per mode" in console.file.getvalue()


def test_plots_cope_with_missing_fidelity(tmp_path: Path) -> None:
    records = [make_record(), make_record(mode="naive", ttft_s=0.5)]
    files = write_plots(aggregate(records), tmp_path)
    assert all(path.read_bytes()[:8] == PNG_MAGIC for path in files.values())


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
        store_stats={"demo-x-exact": {"num_segments": 4, "num_bytes": 10, "num_hits": 2, "num_misses": 1}},
        stats_hints=["http://127.0.0.1:1/v1/stats?namespace=demo-x-exact"],
        json_path=tmp_path / "demo.json", chart_path=tmp_path / "c.png",
    )  # fmt: skip
    console = Console(file=io.StringIO(), width=250)
    for renderable in render_demo(result):
        console.print(renderable)
    output = console.file.getvalue()
    assert "v1/stats?namespace=demo-x-exact" in output and "4.00x" in output
    data = json.loads(json.dumps(demo_json(result), default=str))
    assert {"config", "agents", "aggregates", "records", "store_stats"} <= set(data)
