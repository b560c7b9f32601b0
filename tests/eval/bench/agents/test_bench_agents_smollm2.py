"""`bench agents` end to end on SmolLM2, one reduced run per workload: invariants, not timings.

exact ≡ dense for every call (quant "none"); reuse where it is possible (exact from
the second sample on, naive for agents ≥ 2); a TTFT for every call; files written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.evaluation import use_one_torch_thread

from kvsplice.client.model.models import LoadedModel, ModelConfig, load_model_cached
from kvsplice.eval.bench.agents.bench import run_bench_agents
from kvsplice.eval.bench.agents.config import BenchAgentsConfig
from kvsplice.eval.bench.agents.result import BenchResult
from kvsplice.eval.bench.mode_runner import ProgressEvent

pytestmark = pytest.mark.slow

RUNS = {
    "synthetic": {"samples": 2, "prefix_len": 24, "input_len": 16, "response_len": 6},
    "humaneval": {"samples": 2, "warmup": False},
    "math": {"samples": 1, "warmup": False},
    "mc": {"samples": 1, "warmup": False},
}


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    use_one_torch_thread()
    return load_model_cached(ModelConfig())


@pytest.fixture(scope="module", params=sorted(RUNS))
def bench(
    request: pytest.FixtureRequest, smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> tuple[BenchResult, list[ProgressEvent]]:
    workload = request.param
    config = BenchAgentsConfig(
        workload=workload, num_agents=3, max_new_tokens=6,
        out_dir=tmp_path_factory.mktemp(workload), **RUNS[workload],
    )  # fmt: skip
    events: list[ProgressEvent] = []
    return run_bench_agents(config, smollm2, events.append), events


def test_exact_mode_reproduces_dense_for_every_call(bench) -> None:
    result, _ = bench
    exact = [r for r in result.records if r.mode == "exact"]
    assert exact and all(r.output_matches for r in exact)
    assert all(r.first_token_agrees for r in exact)
    summary = result.aggregates.at("exact")
    assert (
        summary is not None and summary.first_token_agreement == 1.0 and summary.output_match == 1.0
    )


def test_reuse_where_possible(bench) -> None:
    result, _ = bench
    naive_later = [r for r in result.records if r.mode == "naive" and r.position >= 2]
    assert naive_later and all(r.num_reused_tokens > 0 for r in naive_later)
    if result.config.samples >= 2:
        exact_second = [r for r in result.records if r.mode == "exact" and r.sample_index == 1]
        assert all(r.num_reused_tokens > 0 for r in exact_second)
    assert all(r.num_reused_tokens == 0 for r in result.records if r.mode == "dense")


def test_every_call_is_timed_and_final_calls_scored(bench) -> None:
    result, events = bench
    assert all(r.ttft_s > 0 for r in result.records)
    assert len(result.records) == 3 * 3 * result.config.samples
    finals = [r for r in result.records if r.position == 3]
    if result.config.workload == "synthetic":
        assert all(r.correct is None for r in finals)
        assert all(r.num_output_tokens == 6 for r in result.records)  # forced length
    else:
        assert all(r.correct is not None for r in finals)
    assert events[-1].done == events[-1].total


def test_files_written(bench) -> None:
    result, _ = bench
    for path in result.files.values():
        assert Path(path).is_file() and Path(path).stat().st_size > 0
    data = json.loads(result.files["json"].read_text())
    assert data["environment"]["model_fingerprint"] == result.environment["model_fingerprint"]
    assert len(data["records"]) == len(result.records)
    stats = data["store_stats"]
    assert set(stats) == set(result.namespaces) and all(s is not None for s in stats.values())
    assert stats["exact"]["num_segments"] > 0
    assert result.capacity_losses() == {}  # the default 2 GiB holds a reduced run
    assert "Store capacity" not in result.files["markdown"].read_text()


def test_a_store_too_small_for_the_run_is_reported(
    smollm2: LoadedModel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 1 MiB store cannot keep a call's K/V (46 KB a token): the run still completes,
    exact reuses nothing, and the lost segments are named in results.md, the JSON and the log."""
    config = BenchAgentsConfig(
        workload="synthetic", num_agents=2, samples=2, prefix_len=24, input_len=16,
        response_len=6, max_new_tokens=4, warmup=False, modes=("dense", "exact"),
        store_memory_mib=1, out_dir=tmp_path,
    )  # fmt: skip
    result = run_bench_agents(config, smollm2)
    assert all(r.num_reused_tokens == 0 for r in result.records)
    evicted, refused = result.capacity_losses()["exact"]
    assert evicted + refused > 0
    markdown = result.files["markdown"].read_text()
    assert "## Store capacity" in markdown and "exact (" in markdown
    assert "--store-memory-mib" in caplog.text


APPROX_VARIANTS = ("anchor:gamma=1", "multicut:cut=16", "blend:r=0.43", "halo:h=4")


@pytest.fixture(scope="module")
def approx_bench(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> BenchResult:
    """Every approximate mode through the bench on SmolLM2, reduced (3 samples: anchor's pool
    needs two before its gate can reuse)."""
    config = BenchAgentsConfig(
        workload="synthetic", num_agents=3, samples=3, prefix_len=24, input_len=16,
        response_len=6, max_new_tokens=6, warmup=False, modes=("dense", *APPROX_VARIANTS),
        out_dir=tmp_path_factory.mktemp("approx"),
    )  # fmt: skip
    return run_bench_agents(config, smollm2)


def test_every_approximate_mode_runs_end_to_end_and_reuses(approx_bench: BenchResult) -> None:
    by_mode = {g.mode: g for g in approx_bench.aggregates.by_mode}
    assert set(by_mode) == {"dense", "anchor:gamma=1.0", *APPROX_VARIANTS[1:]}
    for label, group in by_mode.items():
        assert group.num_calls == 3 * 3
        assert group.first_token_agreement is not None and group.mean_kl is not None
        if label != "dense":
            assert group.token_reuse_rate > 0, label
    # multicut at layer 16 of 30 reuses about half the layers of what it reuses approximately
    multicut = by_mode["multicut:cut=16"]
    assert multicut.token_layer_reuse_rate is not None
    assert multicut.token_layer_reuse_rate < multicut.token_reuse_rate
    anchor_calls = [r for r in approx_bench.records if r.mode == "anchor:gamma=1.0"]
    assert any(r.decisions.get("anchor_gate") == "confident" for r in anchor_calls)
    assert any(
        s["mode"] == "anchor" and not s["exact"] for r in anchor_calls for s in r.reused_spans
    )


def test_the_speedup_vs_fidelity_plot_has_every_variant(approx_bench: BenchResult) -> None:
    assert approx_bench.files["speedup_fidelity_plot"].stat().st_size > 0
    saved = json.loads(approx_bench.files["json"].read_text())
    assert {g["mode"] for g in saved["aggregates"]["by_mode"]} == {
        "dense", "anchor:gamma=1.0", *APPROX_VARIANTS[1:],
    }  # fmt: skip
