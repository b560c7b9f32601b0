"""The demo end to end on SmolLM2 with one HumanEval problem and short outputs (slow)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from helpers.evaluation import use_one_torch_thread
from rich.console import Console

from kvsplice.client.model.models import ModelConfig, load_model_cached
from kvsplice.client.modes.admission import load_policy
from kvsplice.eval.bench.demo.bench import DemoResult, render_demo, run_agents_demo
from kvsplice.eval.bench.demo.config import DemoConfig
from kvsplice.eval.bench.mode_runner import ProgressEvent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[DemoResult, list[ProgressEvent]]:
    use_one_torch_thread()
    loaded = load_model_cached(ModelConfig())
    config = DemoConfig(
        num_problems=1, max_new_tokens=6, warmup=False, out_dir=tmp_path_factory.mktemp("demo")
    )
    events: list[ProgressEvent] = []
    return run_agents_demo(config, events.append, loaded), events


def test_demo_rows_cover_five_agents_with_exact_equal_to_dense(demo) -> None:
    result, events = demo
    assert [row.position for row in result.rows] == [1, 2, 3, 4, 5]
    for row in result.rows:
        assert row.dense_ttft_s > 0 and all(t > 0 for t in row.ttft_s.values())
        assert row.first_token_agreement["exact"] == 1.0 and row.output_match["exact"] == 1.0
    assert all(row.reuse_rate["naive"] > 0 for row in result.rows[1:])
    assert events[-1].done == events[-1].total == 20  # dense, exact, naive, gated


def test_demo_ends_with_a_judge_and_the_gate_keeps_judges_off_unadmitted_modes(demo) -> None:
    result, _ = demo
    judge = result.judge
    assert judge is not None
    summaries = {s.mode: s for s in judge.summaries}
    assert set(summaries) == {"dense", "naive", "gated"} and summaries["dense"].jcr == 1.0
    policy = load_policy(None, str(result.environment["model_fingerprint"]))
    allowed = {*policy.judge_modes, "exact", "dense"}
    judge_routes = [d for (stage, d), _ in judge.routes.items() if stage == "judge"]
    assert judge_routes and all(
        d.startswith("judge (answers=5+selection) -> ") for d in judge_routes
    )
    assert {d.split(" -> ")[1].split(":")[0] for d in judge_routes} <= allowed
    pipeline = [d for (stage, d), _ in judge.routes.items() if stage == "pipeline"]
    assert pipeline and all(d.startswith("ordinary (") for d in pipeline)


def test_demo_writes_chart_json_and_points_at_the_store(demo) -> None:
    result, _ = demo
    assert result.chart_path.read_bytes()[:4] == b"\x89PNG"
    data = json.loads(Path(result.json_path).read_text())
    assert len(data["agents"]) == 5 and data["namespaces"] == result.namespaces
    assert (result.config.out_dir / "store-lmdb").is_dir()
    assert all(stats and stats.num_segments > 0 for stats in result.store_stats.values())
    console = Console(file=io.StringIO(), width=250)
    for renderable in render_demo(result):
        console.print(renderable)
    output = console.file.getvalue()
    assert "/v1/stats?namespace=" in output and str(result.json_path) in output
    assert "What the risk gate routed" in output and data["judge"]["modes"]
