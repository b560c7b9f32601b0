"""`bench judge` end to end on SmolLM2, reduced: dense JCR = 100% against itself, the store
holds the teacher-forced candidates (naive reuses every candidate token·layer), files written,
and `gated` never sends a judge to a mode its policy did not admit for judges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.evaluation import use_one_torch_thread

from kvsplice.client.model.models import LoadedModel, ModelConfig, load_model_cached
from kvsplice.client.modes.admission import AdmissionPolicy
from kvsplice.eval.bench.judge.bench import run_bench_judge
from kvsplice.eval.bench.judge.config import BenchJudgeConfig
from kvsplice.eval.bench.judge.result import BenchJudgeResult
from kvsplice.eval.bench.mode_runner import ProgressEvent
from kvsplice.eval.workloads.judge_examples import JUDGE_SAMPLE, load_judge_data

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    use_one_torch_thread()
    return load_model_cached(ModelConfig())


@pytest.fixture(scope="module")
def given_sets(
    smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> tuple[BenchJudgeResult, list[ProgressEvent]]:
    """Two given candidate sets of the sample (gsm8k), shuffled, with diagnostics."""
    out = tmp_path_factory.mktemp("judge")
    config = BenchJudgeConfig(
        data_path=JUDGE_SAMPLE, task="gsm8k", examples=2, modes=("dense", "naive"),
        warmup=False, out_dir=out, json_path=out / "copy.json", judge_max_new_tokens=3,
    )  # fmt: skip
    events: list[ProgressEvent] = []
    return run_bench_judge(config, smollm2, events.append), events


def test_dense_agrees_with_itself_on_every_example(given_sets) -> None:
    result, _ = given_sets
    dense = next(s for s in result.summaries if s.mode == "dense")
    assert dense.examples == 2 and dense.jcr == 1.0
    for record in result.run.records:
        if record.mode == "dense":  # the same computation as the reference, bit for bit
            assert record.margin == record.dense_margin
            assert record.text == record.dense_text


def test_the_store_holds_every_teacher_forced_candidate(given_sets) -> None:
    result, _ = given_sets
    naive = next(s for s in result.summaries if s.mode == "naive")
    assert naive.candidate_token_layer_reuse == 1.0
    assert 0 < naive.token_reuse < 1


def test_dense_and_reuse_judges_see_the_same_order_mapped_to_agents(given_sets) -> None:
    result, _ = given_sets
    for record in result.run.records:
        order = result.run.orders[record.example_id]
        assert record.order == order.agent_ids and sorted(order.agent_ids) == ["1", "2", "3", "4"]
        assert record.agent_id == order.agent_ids[record.slot]
        assert record.dense_agent_id == order.agent_ids[record.dense_slot]


def test_json_shape_and_files(given_sets) -> None:
    result, events = given_sets
    document = json.loads(Path(result.files["--json"]).read_text())
    assert document == json.loads(Path(result.files["json"]).read_text())
    assert [m["mode"] for m in document["modes"]] == ["dense", "naive"]
    for mode in document["modes"]:
        assert mode["examples"] == 2
        for key in ("jcr", "coverage", "candidate_token_layer_reuse"):
            assert 0.0 <= mode[key] <= 1.0
        assert mode["speedup"] > 0
    assert {p["mode"] for p in document["attention"]} == {"reference", "dense", "naive"}
    for name in ("markdown", "jcr plot", "attention plot"):
        assert result.files[name].stat().st_size > 0
    assert "| naive | 2 |" in result.files["markdown"].read_text()
    assert events[-1].done == events[-1].total
    # the judged sets, in --data format: judging them again judges the same sets
    again = load_judge_data(result.files["candidates"])
    assert again == load_judge_data(JUDGE_SAMPLE)[:2]


def test_generated_candidates_parallel_regime(smollm2: LoadedModel, tmp_path: Path) -> None:
    config = BenchJudgeConfig(
        task="mmlu", regime="parallel", num_candidates=2, examples=1, shuffle=False,
        modes=("dense", "anchor"), max_new_tokens=4, judge_max_new_tokens=2, warmup=False,
        diagnostics=False, out_dir=tmp_path,
    )  # fmt: skip
    result = run_bench_judge(config, smollm2)
    (example,) = result.run.candidates.values()
    assert sorted(example.texts) == ["1", "2"]
    assert result.run.orders[next(iter(result.run.orders))].agent_ids == ("1", "2")  # fixed
    assert result.summaries[0].jcr == 1.0
    (saved,) = load_judge_data(result.files["candidates"])  # generated, kept to judge again
    assert saved.candidates == tuple(example.texts.values()) and saved.task == "mmlu"


@pytest.mark.parametrize("judge_modes", [(), ("crossfix",)], ids=["none-for-judges", "crossfix"])
def test_gated_never_sends_a_judge_to_a_mode_not_admitted_for_judges(
    smollm2: LoadedModel, tmp_path: Path, judge_modes: tuple[str, ...]
) -> None:
    """The policy admits naive for ordinary calls; judges go only where judge probes said."""
    admitted = ("dense", "exact", "naive", *judge_modes)
    policy = AdmissionPolicy(smollm2.fingerprint, admitted, judge_modes=judge_modes)
    config = BenchJudgeConfig(
        data_path=JUDGE_SAMPLE, examples=3, modes=("dense", "gated"), warmup=False,
        out_dir=tmp_path, judge_max_new_tokens=2, diagnostics=False, admission=policy,
        layout="persona-first",  # the judge quotes the answers: none is in an exact chain
    )  # fmt: skip
    result = run_bench_judge(config, smollm2)
    gated = [r for r in result.run.records if r.mode == "gated"]
    assert len(gated) == 3
    allowed = judge_modes or ("exact",)
    for record in gated:
        route = record.decisions["gated"]
        assert route.startswith("judge (answers=4+selection) -> ")
        assert route.split(" -> ")[1].split(":")[0] in allowed  # never naive
    if not judge_modes:  # exact after the exact prefix: the dense judge's choice, nothing reused
        assert all(r.consistent and r.num_candidate_token_layers_reused == 0 for r in gated)


def test_a_transcript_judge_reads_every_candidate_from_the_agents_chain(
    smollm2: LoadedModel, tmp_path: Path
) -> None:
    """The agents speak in display order and the judge takes the last turn: `exact` (and
    `gated`, whatever it routes to) reads every candidate token·layer the agents stored,
    with zero drift; persona-first, exact reads none (the test above)."""
    config = BenchJudgeConfig(
        data_path=JUDGE_SAMPLE, examples=3, modes=("dense", "exact", "gated"), warmup=False,
        out_dir=tmp_path, judge_max_new_tokens=2, diagnostics=False, layout="transcript",
    )  # fmt: skip
    result = run_bench_judge(config, smollm2)
    for mode in ("exact", "gated"):
        summary = next(s for s in result.summaries if s.mode == mode)
        assert summary.examples == 3 and summary.jcr == 1.0
        assert summary.candidate_token_layer_reuse == 1.0
    for record in result.run.records:
        if record.mode == "exact":  # the same choice, from logits within fp tolerance
            assert abs(record.margin - record.dense_margin) < 1e-3
    assert json.loads(result.files["json"].read_text())["config"]["layout"] == "transcript"
