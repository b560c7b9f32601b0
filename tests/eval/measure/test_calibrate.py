"""Calibration: the selection rule on hand-built measurements, and one tiny end-to-end run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.evaluation import ToyWorkload, make_tiny_loaded, use_one_torch_thread

from kvsplice.client.modes.admission import load_policy
from kvsplice.client.modes.anchor.policy import Params as AnchorParams
from kvsplice.client.modes.blend import Params as BlendParams
from kvsplice.client.modes.crossfix import Params as CrossfixParams
from kvsplice.client.modes.halo import Params as HaloParams
from kvsplice.client.modes.multicut import W_EXACT_TABLES
from kvsplice.client.modes.multicut import Params as MulticutParams
from kvsplice.client.modes.params import knobs
from kvsplice.client.modes.registry import mode_spec
from kvsplice.common.errors import FingerprintMismatch
from kvsplice.eval.measure.calibrate import (
    CalibrationConfig,
    Thresholds,
    build_policy,
    judge_examples,
    render_calibration,
    render_judge_probes,
    run_calibration,
    select,
    write_policy,
)
from kvsplice.eval.measure.calibrate_probes import (
    Candidate,
    Measurement,
    candidate_grid,
    percentile,
)
from kvsplice.eval.measure.judge_probes import JudgeProbe, JudgeThresholds
from kvsplice.eval.workloads.judge_examples import JUDGE_SAMPLE, load_judge_data

FP = "kvfp1-" + "a" * 32
OTHER_FP = "kvfp1-" + "b" * 32
PERMISSIVE = MulticutParams(w_exact=W_EXACT_TABLES["permissive"])
THRESHOLDS = Thresholds(max_mean_kl=0.05, min_first_token_agreement=0.95)


def make_measurement(
    mode: str = "blend",
    label: str = "r=0.3",
    params: object = None,
    rank: int = 0,
    kl: float = 0.01,
    agreement: float = 1.0,
    reuse: float = 0.5,
    layer_reuse: float = 0.4,
    approx_reuse: float = 0.3,
) -> Measurement:
    candidate = Candidate(mode, label, params or mode_spec(mode).params_type(), rank)
    return Measurement(candidate, 6, kl, 2 * kl, agreement, reuse, layer_reuse, approx_reuse)


def blend(ratio: float, rank: int, **kw: float) -> Measurement:
    return make_measurement("blend", f"r={ratio}", BlendParams(ratio=ratio), rank, **kw)


def test_picks_the_most_saving_passing_parameter() -> None:
    rows = [
        blend(0.15, 0, kl=0.2, layer_reuse=0.6),  # saves most, drifts too much
        blend(0.3, -1, kl=0.03, layer_reuse=0.5),
        blend(0.5, -2, kl=0.01, layer_reuse=0.3),
    ]
    chosen = select(rows, THRESHOLDS)
    assert chosen["blend"] is rows[1]
    assert build_policy(FP, chosen).params_of("blend") == BlendParams(ratio=0.3)


def test_thresholds_are_inclusive_at_the_boundary() -> None:
    assert THRESHOLDS.passes(make_measurement(kl=0.05, agreement=0.95))
    assert not THRESHOLDS.passes(make_measurement(kl=0.0500001))
    assert not THRESHOLDS.passes(make_measurement(agreement=0.9499))


def test_a_parameter_whose_approximation_never_ran_measured_nothing_and_does_not_pass() -> None:
    assert not THRESHOLDS.passes(
        make_measurement(kl=0.0, reuse=0.0, layer_reuse=0.0, approx_reuse=0.0)
    )
    exact_prefix_only = make_measurement(
        "anchor", kl=0.0, reuse=0.12, layer_reuse=0.12, approx_reuse=0.0
    )
    assert not THRESHOLDS.passes(exact_prefix_only)


def test_equal_measured_reuse_is_broken_by_the_parameters_rank() -> None:
    rows = [blend(0.5, -2), blend(0.15, 0), blend(0.3, -1)]
    assert select(rows, THRESHOLDS)["blend"].candidate.label == "r=0.15"


def test_admits_dense_exact_and_exactly_the_modes_with_a_passing_parameter() -> None:
    rows = [
        make_measurement("naive", "-", kl=0.4, agreement=0.5),
        make_measurement("halo", "h=2", HaloParams(num_halo=2), 0, kl=0.09),
        make_measurement("halo", "h=8", HaloParams(num_halo=8), -2, kl=0.02, layer_reuse=0.3),
        make_measurement("anchor", "γ=0.5", AnchorParams(gamma=0.5), 1, agreement=0.9),
        make_measurement("multicut", "permissive", PERMISSIVE, 2),
    ]
    policy = build_policy(FP, select(rows, THRESHOLDS), "2026-01-01T00:00:00+00:00")
    assert policy.admitted_modes == ("dense", "exact", "halo", "multicut")
    assert policy.params_of("halo").num_halo == 8
    assert policy.params_of("multicut").w_exact == W_EXACT_TABLES["permissive"]
    assert policy.params_of("anchor").gamma == 0.3  # not admitted: the default stays
    assert set(policy.drift) == {"halo", "multicut"}
    assert policy.drift["halo"].kl_mean_nats == 0.02
    assert policy.drift["halo"].kl_p95_nats == 0.04


def test_grid_ranks_the_more_saving_parameter_higher() -> None:
    grid = candidate_grid()
    rank = {(c.mode, c.label): c.rank for c in grid}
    assert rank["anchor", "γ=0.3"] > rank["anchor", "γ=1.0 r=0.15"]
    repaired = next(c for c in grid if c.label == "γ=1.0 r=0.15")
    assert repaired.params == AnchorParams(gamma=1.0, repair_ratio=0.15)
    assert rank["blend", "r=0.15"] > rank["blend", "r=0.3"] > rank["blend", "r=0.5"]
    assert rank["halo", "h=2"] > rank["halo", "h=8"]
    assert rank["anchor", "γ=1.0"] > rank["anchor", "γ=0.5"] > rank["anchor", "γ=0.3"]
    assert rank["multicut", "permissive"] > rank["multicut", "conservative"]
    assert [c.mode for c in grid].count("naive") == 1
    assert {c.mode for c in grid} == {"naive", "anchor", "multicut", "blend", "halo"}  # no mask


def test_the_grid_is_the_knobs_metadata() -> None:
    by_mode = {mode: [c for c in candidate_grid((mode,))] for mode in ("blend", "multicut")}
    assert [c.params.ratio for c in by_mode["blend"]] == list(knobs(BlendParams)["ratio"].grid)
    assert [c.label for c in by_mode["multicut"]] == list(W_EXACT_TABLES)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.95) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.95) == 3.0
    assert percentile([float(i) for i in range(1, 21)], 0.95) == 19.0


def test_config_names_a_bad_value() -> None:
    with pytest.raises(ValueError, match="probes"):
        CalibrationConfig(probes=0)
    with pytest.raises(ValueError, match="cacheblend"):
        CalibrationConfig(modes=("cacheblend",))
    with pytest.raises(ValueError, match="max_mean_kl"):
        Thresholds(max_mean_kl=-1.0)


@pytest.mark.slow
def test_end_to_end_on_a_tiny_model_writes_a_policy_for_that_model(tmp_path: Path) -> None:
    use_one_torch_thread()
    loaded = make_tiny_loaded()
    labels = {"naive": "-", "anchor": "γ=0.5", "multicut": "permissive", "blend": "r=0.3",
              "halo": "h=2"}  # fmt: skip
    grid = tuple(c for c in candidate_grid() if labels[c.mode] == c.label)
    config = CalibrationConfig(
        probes=1,
        num_agents=2,
        max_new_tokens=3,
        grid=grid,
        namespace="calibrate-test",
        judge_probes=0,
    )
    events: list[str] = []
    result = run_calibration(config, events.append, loaded=loaded, workload=ToyWorkload())
    assert [m.mode for m in result.measurements] == ["naive", "anchor", "multicut", "blend", "halo"]
    assert len(events) == 5 * 2 and all(m.num_calls == 2 for m in result.measurements)
    path = tmp_path / "policy.json"
    write_policy(result, path)
    policy = load_policy(path, loaded.fingerprint)
    passing = {m.mode for m in result.measurements if result.thresholds.passes(m)}
    assert set(policy.admitted_modes) == {"dense", "exact"} | passing
    for mode in passing:
        assert policy.drift[mode].kl_mean_nats <= config.thresholds.max_mean_kl
    with pytest.raises(FingerprintMismatch):
        load_policy(path, OTHER_FP)
    assert render_calibration(result).row_count == 5
    # the judge routes' cost model was timed on this model and travels in the policy
    assert policy.cost is not None and policy.cost.s_per_token_layer > 0


@pytest.mark.slow
def test_judge_probes_admit_the_judge_mode_that_reused_most() -> None:
    use_one_torch_thread()
    loaded = make_tiny_loaded()
    config = CalibrationConfig(
        modes=(), judge_probes=2, judge_seeds=(0,), judge_thresholds=JudgeThresholds(min_jcr=0.0)
    )
    result = run_calibration(config, loaded=loaded)
    singles = [s for _, s in config.judge_candidates()]
    assert [p.spec for p in result.judge_probes][: len(singles)] == singles
    checks = len(knobs(CrossfixParams)["check_layer"].grid)
    staged = result.judge_probes[len(singles) :]  # every cheaper check before a deeper one
    assert len(staged) == checks * (checks - 1) // 2
    assert all("+deep=" in p.spec for p in staged)
    assert all(p.num_probes == 2 for p in result.judge_probes)
    best = max(
        (p for p in result.judge_probes if p.admitted), key=lambda p: (p.reuse, p.jcr, p.ceiling)
    )
    policy = result.policy
    assert policy.judge_modes == ("crossfix",) and "crossfix" in policy.admitted_modes
    assert policy.params_of("crossfix").min_margin == best.min_margin
    assert policy.judge_drift["crossfix"].jcr == best.jcr
    assert policy.serving_mode == "exact"  # a judge mode never serves ordinary calls
    assert render_judge_probes(result).row_count == len(result.judge_probes)


def test_a_judge_variant_sets_its_parameters_on_every_judge_candidate() -> None:
    plain = CalibrationConfig(modes=()).judge_candidates()
    asking = CalibrationConfig(modes=(), judge_variant="q=1").judge_candidates()
    assert [s.replace("+q=1", "") for _, s in asking] == [s for _, s in plain]
    assert all(s.endswith("+q=1+margin=0") for _, s in asking)
    with pytest.raises(ValueError, match="q"):
        CalibrationConfig(modes=(), judge_variant="q=2")
    with pytest.raises(ValueError, match="nope"):
        CalibrationConfig(modes=(), judge_variant="nope=1")


def _probe(spec: str, jcr: float, reuse: float, admitted: bool) -> JudgeProbe:
    return JudgeProbe("crossfix", spec, 12, 0.5, 0.65, jcr, jcr, 0.7, reuse, admitted)


def test_a_tie_in_reuse_goes_to_the_probe_whose_cheapest_pass_reuses_most() -> None:
    single = _probe("crossfix:check=24+margin=0", 1.0, 0.15, admitted=True)
    staged = replace(
        _probe("crossfix:check=12+deep=24+deep_margin=0.15+margin=0", 1.0, 0.15, admitted=True),
        ceiling=0.6,
    )
    policy = build_policy(FP, {}, judges=[replace(single, ceiling=0.2), staged])
    params = policy.params_of("crossfix")
    assert (params.check_layer, params.deep_check, params.deep_margin) == (12, 24, 0.15)
    assert params.min_margin == staged.min_margin


def test_only_a_judge_probe_that_cleared_the_bar_is_admitted_for_judges() -> None:
    failing = [_probe("crossfix:r=0.3+margin=0", 0.9, 0.5, admitted=False)]
    assert build_policy(FP, {}, judges=failing).judge_modes == ()
    assert build_policy(FP, {}, judges=()).admitted_modes == ("dense", "exact")
    passing = _probe("crossfix:r=0.45+margin=0", 1.0, 0.3, admitted=True)
    policy = build_policy(FP, {}, judges=[*failing, passing])
    assert policy.judge_modes == ("crossfix",)
    params = policy.params_of("crossfix")
    assert (params.ratio, params.min_margin) == (0.45, 0.65)


def test_judge_probes_read_the_deployments_own_candidate_sets(tmp_path: Path) -> None:
    data = tmp_path / "judge.jsonl"
    record = {"task": "mmlu", "question": "Which?", "candidates": ["A", "B", "C"]}
    data.write_text("".join(json.dumps({"id": i, **record}) + "\n" for i in ("q1", "q2", "q3")))
    config = CalibrationConfig(modes=(), judge_probes=2, judge_data=data)
    assert [e.example_id for e in judge_examples(config)] == ["q1", "q2"]
    shipped = judge_examples(CalibrationConfig(modes=(), judge_probes=100))
    assert [e.example_id for e in shipped] == [e.example_id for e in load_judge_data(JUDGE_SAMPLE)]
