"""`bench agents` over several layouts on SmolLM2 (reduced): side-by-side files, exact ≡ dense."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.evaluation import use_one_torch_thread

from kvsplice.agents.layouts import LAYOUTS
from kvsplice.client.model.models import LoadedModel, ModelConfig, load_model_cached
from kvsplice.eval.bench.agents.bench import run_bench_layouts
from kvsplice.eval.bench.agents.config import BenchAgentsConfig
from kvsplice.eval.bench.agents.result import BenchResult

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[BenchResult], dict[str, Path]]:
    use_one_torch_thread()
    loaded: LoadedModel = load_model_cached(ModelConfig())
    config = BenchAgentsConfig(
        workload="synthetic", num_agents=3, modes=("dense", "exact"), samples=1,
        prefix_len=16, input_len=12, response_len=5, warmup=False,
        out_dir=tmp_path_factory.mktemp("layouts"),
    )  # fmt: skip
    return run_bench_layouts(config, LAYOUTS, loaded)


def test_each_layout_is_exact_against_its_own_dense(runs) -> None:
    results, _ = runs
    assert [r.config.layout for r in results] == list(LAYOUTS)
    for result in results:
        exact = [r for r in result.records if r.mode == "exact"]
        assert exact and all(r.output_matches and r.first_token_agrees for r in exact)


def test_the_comparison_shows_the_transcript_reusing_most(runs) -> None:
    results, files = runs
    rows = json.loads(files["layouts_json"].read_text())
    reuse = {row["layout"]: row["token_reuse_rate"] for row in rows if row["mode"] == "exact"}
    assert reuse["persona-first"] < reuse["shared-first"] < reuse["transcript"]
    assert all(len(row["speedup_by_position"]) == 3 for row in rows)
    assert rows[0]["dense_final_same_as_first_layout"] == 1.0  # the base against itself
    assert "| transcript | exact |" in files["layouts_markdown"].read_text()
    for result in results:  # each layout's own files, in its own folder
        assert result.files["json"].parent.name == result.config.layout
