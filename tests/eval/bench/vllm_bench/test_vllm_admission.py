"""The graded yardstick: decisions by problem, refusing damaged controls and blind evidence,
the policy it writes for engines, held-out confirmation, `bench vllm-graded --admit`."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvsplice.client.modes.admission import AdmissionPolicy
from kvsplice.eval.bench.vllm import admission as va
from kvsplice.eval.bench.vllm import yardstick as ys
from kvsplice.integrations.vllm.reuse_policy import admits_spans

FINGERPRINT = "kvfp1-" + "ab" * 16
ROLES = ("solver", "reviser", "judge")
LATER = "2099-01-01T00:00:00+00:00"  # runs that started after the rule's commit
DECISION_KEYS = {
    "config",
    "admitted",
    "points",
    "ci95",
    "problems",
    "discordant",
    "recompute_accuracy",
}
Right = tuple[bool, bool, bool]
# the problems calibration runs grade, in the rule's order (`YardstickRule.calibration_draw`)
DRAW = ys.load_rule().calibration_draw("mmlu", 14_042, 400)


def _recompute(num_problems: int, seed: int = 1) -> list[Right]:
    """MMLU-like answers off the floor and the ceiling: solver ~40%, reviser ~45% right."""
    rng = random.Random(seed)
    runs = []
    for _ in range(num_problems):
        solver = rng.random() < 0.4
        reviser = solver if rng.random() < 0.8 else not solver
        runs.append((solver, reviser, rng.random() < 0.6))
    return runs


def _damaged(runs: list[Right], share: float, seed: int = 2) -> list[Right]:
    """`runs` with each right code answer made wrong with probability `share`."""
    rng = random.Random(seed)
    return [
        (s and rng.random() >= share, r and rng.random() >= share, j) for s, r, j in runs
    ]  # fmt: skip


def _flipped(runs: list[Right], num: int) -> list[Right]:
    """`num` problems' solver answer flipped each way (no net effect)."""
    out, wrong_made, right_made = list(runs), 0, 0
    for i, (s, r, j) in enumerate(runs):
        if s and wrong_made < num:
            out[i], wrong_made = (False, r, j), wrong_made + 1
        elif not s and right_made < num:
            out[i], right_made = (True, r, j), right_made + 1
    return out


def _runs(
    rights: list[Right], first: int = 0, truncated: bool = False, judge_always: bool = False
) -> list[dict[str, Any]]:
    """Runs as `GradedRun.as_json` writes them; the judge graded where the candidates are
    one right, one wrong (MMLU's judge), or always (HumanEval's)."""
    return [
        {
            "problem": f"mmlu-test-{DRAW[first + i]}", "right": dict(zip(ROLES, r, strict=True)),
            "judge_graded": judge_always or r[0] != r[1], "judge_verdict": "B" if r[2] else "C", "truncated": dict.fromkeys(ROLES, truncated),
            "cached_tokens": [0, 300, 300, 300, 300], "prompt_tokens": [400] * 5,
            "ttft_s": [0.2] * 4 + [1.0 + i % 3],
        }
        for i, r in enumerate(rights)
    ]  # fmt: skip


def _pooled(configs: dict[str, list[Right]], first: int = 0) -> dict[str, Any]:
    return {
        "configs": [
            {"label": label if label == "recompute" else f"{label} (apc on)",
             "graded": {"runs": _runs(rights, first)}}
            for label, rights in configs.items()
        ]
    }  # fmt: skip


def _rule(**changes: Any) -> ys.YardstickRule:
    from dataclasses import replace

    return replace(ys.load_rule(), **changes)


def _committed_rule(tmp_path: Path) -> Path:
    """The shipped rule committed in a repository of its own (as the project commits it)."""
    repo = tmp_path / "repo"
    repo.mkdir(parents=True)
    shutil.copy(ys.RULE_PATH, repo / ys.RULE_PATH.name)
    for args in (("init", "-q"), ("add", "."), ("commit", "-qm", "rule")):
        _git(repo, *args)
    return repo / ys.RULE_PATH.name


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True
    )


def _reports(started_at: str = LATER) -> list[dict[str, Any]]:
    return [{"workload": "mmlu", "started_at": started_at, "served_fingerprint": FINGERPRINT}]


def _all_configs(num: int = 150) -> dict[str, list[Right]]:
    recompute = _recompute(num)
    return {
        "recompute": recompute, "kvsplice": list(recompute),
        "kvsplice-gated": _flipped(recompute, 2),
        "control-unrotated": _damaged(recompute, 0.3), "control-noise": _damaged(recompute, 0.15, 3),
    }  # fmt: skip


def test_the_floor_evidence_the_review_found_grades_nothing_and_admits_nothing() -> None:
    """Issue 50's shipped evidence: the judge says FAIL every time (right 97%), code roles
    at 3%. A mode that breaks every code answer is refused: no role sits in the band."""
    recompute = [(False, False, True)] * 113 + [(True, True, False)] * 3
    broken = [(False, False, True)] * 116
    decision = ys.decide(
        "kvsplice-gated", _runs(broken, judge_always=True), _runs(recompute, judge_always=True),
        _rule(),
    )  # fmt: skip
    assert not decision.admitted and "no graded role" in decision.reason
    assert decision.recompute_accuracy == {
        "solver": 3 / 116,
        "reviser": 3 / 116,
        "judge": 113 / 116,
    }


def test_exact_is_admitted_the_damaged_controls_refused_and_naive_decided_by_its_interval(
    tmp_path: Path,
) -> None:
    found = {d.config: d for d in ys.decisions(_pooled(_all_configs()), _rule())}
    assert found["kvsplice"].admitted and found["kvsplice"].ci95 == (0.0, 0.0)
    assert found["kvsplice"].jcr == 1.0
    for control in ("control-unrotated", "control-noise"):
        assert not found[control].admitted and found[control].points < -2, found[control].reason
    gated = found["kvsplice-gated"]
    assert gated.admitted and gated.discordant == 4 and abs(gated.points) < 0.5
    assert -2 <= gated.ci95[0] < 0 < gated.ci95[1] and gated.loaded_share == 0.75
    assert gated.agent5_ttft_s == 2.0 and gated.as_json()["agent5_ttft_s"] == 2.0  # of 1, 2, 3
    untimed = [{k: v for k, v in run.items() if k != "ttft_s"} for run in _runs(_recompute(150))]
    assert ys.decide("kvsplice", untimed, untimed, _rule()).agent5_ttft_s is None  # older reports
    assert set(gated.graded_roles) == {"solver", "reviser", "judge"}
    policy, summary = va.admit(
        _reports(), _pooled(_all_configs()), FINGERPRINT, _rule(), _committed_rule(tmp_path)
    )
    assert policy.admitted_modes == ("dense", "exact", "naive"), summary
    path = tmp_path / "policy.json"
    path.write_text(policy.to_json())
    written = json.loads(path.read_text())
    assert [d["config"] for d in written["decisions"]] == [
        "kvsplice", "kvsplice-gated", "control-unrotated", "control-noise"
    ]  # fmt: skip
    assert all(set(d) >= DECISION_KEYS for d in written["decisions"])
    assert written["yardstick"]["sensitive"] and admits_spans(str(path), FINGERPRINT)
    assert AdmissionPolicy.from_json(path.read_text()) == policy


def test_a_yardstick_that_admits_a_control_admits_no_mode(tmp_path: Path) -> None:
    configs = _all_configs()
    configs["control-noise"] = list(configs["recompute"])  # a control that damaged nothing
    policy, summary = va.admit(_reports(), _pooled(configs), FINGERPRINT, _rule(),
                               _committed_rule(tmp_path))  # fmt: skip
    assert policy.admitted_modes == ("dense", "exact")
    assert "not sensitive: it admits the damaged control-noise" in summary
    del configs["control-noise"]
    policy, summary = va.admit(_reports(), _pooled(configs), FINGERPRINT, _rule(),
                               _committed_rule(tmp_path / "b"))  # fmt: skip
    assert policy.admitted_modes == ("dense", "exact") and "control-noise was not graded" in summary


def test_too_few_problems_truncated_answers_and_a_wide_interval_are_refused() -> None:
    recompute = _recompute(60)
    few = ys.decide("kvsplice", _runs(recompute), _runs(recompute), _rule())
    assert not few.admitted and "60 problems graded < 100" in few.reason
    many = _recompute(150)
    cut = ys.decide("kvsplice", _runs(many, truncated=True), _runs(many), _rule())
    assert not cut.admitted and "token cap" in cut.reason
    noisy = _flipped(many, 12)  # no net effect, but too much discordance for 150 problems
    wide = ys.decide("kvsplice-gated", _runs(noisy), _runs(many), _rule())
    assert not wide.admitted and abs(wide.points) < 1 and wide.ci95[0] < -2
    assert wide.problems_for_half_width is not None and wide.problems_for_half_width > 150


def test_jcr_counts_judges_answering_as_recompute_s_where_gradable() -> None:
    reference = [(True, False, True)] * 50 + [(True, True, True)] * 50  # gradable: the first 50
    flipped = [(s, r, not j) if i % 2 else (s, r, j) for i, (s, r, j) in enumerate(reference)]
    found = ys.decide("x", _runs(flipped), _runs(reference), _rule())
    assert found.jcr == 0.5


def test_the_interval_is_by_problem_not_by_answer() -> None:
    """Three answers of one pipeline move together: resampling problems gives a wider
    interval than treating the answers as independent would."""
    many = _recompute(150)
    together = [(not s, not r, j) if i < 6 else (s, r, j) for i, (s, r, j) in enumerate(many)]
    found = ys.decide("x", _runs(together), _runs(many), _rule())
    singles = [
        float(int(a) - int(b)) for t, m in zip(together, many, strict=True)
        for a, b in zip(t[:2], m[:2], strict=True)
    ]  # fmt: skip
    independent = ys.bootstrap(singles, _rule())
    assert found.ci95[1] - found.ci95[0] > independent[1] - independent[0]


def test_a_rule_committed_after_the_runs_or_not_committed_admits_nothing(tmp_path: Path) -> None:
    rule_path = _committed_rule(tmp_path)
    early = _reports(started_at="2000-01-01T00:00:00+00:00")
    policy, summary = va.admit(early, _pooled(_all_configs()), FINGERPRINT, _rule(), rule_path)
    assert policy.admitted_modes == ("dense", "exact") and "after a run started" in summary
    rule_path.write_text(
        rule_path.read_text().replace('"tolerance_points": 2.0', '"tolerance_points": 9.0')
    )
    policy, summary = va.admit(_reports(), _pooled(_all_configs()), FINGERPRINT, _rule(), rule_path)
    assert policy.admitted_modes == ("dense", "exact") and "not committed" in summary


def test_a_rule_moved_unchanged_keeps_the_commit_that_fixed_it(tmp_path: Path) -> None:
    rule_path = _committed_rule(tmp_path)
    fixed = ys.rule_commit(rule_path)
    moved = rule_path.parent / "moved" / rule_path.name
    moved.parent.mkdir()
    _git(rule_path.parent, "mv", rule_path.name, "moved/")
    _git(rule_path.parent, "commit", "-qm", "move")
    assert fixed is not None and ys.rule_commit(moved) == fixed
    moved.write_text(
        moved.read_text().replace('"tolerance_points": 2.0', '"tolerance_points": 9.0')
    )
    _git(rule_path.parent, "commit", "-qam", "change")
    changed = ys.rule_commit(moved)
    assert changed is not None and changed[0] != fixed[0]


def test_calibration_on_held_out_problems_is_an_error_and_held_out_runs_confirm(
    tmp_path: Path,
) -> None:
    rule = _rule()
    drawn = sorted(rule.held_out("mmlu", 14_042))
    assert len(drawn) == 200 and drawn == sorted(_rule().held_out("mmlu", 14_042))  # by seed
    calibration = _pooled(_all_configs())
    calibration["configs"][0]["graded"]["runs"][0]["problem"] = f"mmlu-test-{drawn[0]}"
    with pytest.raises(ValueError, match="held-out problems"):
        va.admit(_reports(), calibration, FINGERPRINT, rule, _committed_rule(tmp_path))
    policy, _ = va.admit(_reports(), _pooled(_all_configs()), FINGERPRINT, rule,
                         _committed_rule(tmp_path / "b"))  # fmt: skip
    held = _pooled(_all_configs(len(drawn)))
    for row in held["configs"]:
        for run, index in zip(row["graded"]["runs"], drawn, strict=True):
            run["problem"] = f"mmlu-test-{index}"
    confirmed, why, _ = va.confirm(_reports(), held, policy, FINGERPRINT, rule)
    assert confirmed, why
    with pytest.raises(ValueError, match="not held out"):
        va.confirm(_reports(), _pooled(_all_configs()), policy, FINGERPRINT, rule)


def _report_file(tmp_path: Path, configs: dict[str, list[Right]]) -> Path:
    pooled = _pooled(configs)
    for row in pooled["configs"]:
        row["name"] = row["label"]
        row["graded"].update(roles={}, outputs_equal_recompute=0, outputs=0)
    report = {
        **pooled, "model_dir": "/models/m", "dtype": "float32", "layout": "persona-first",
        "answer_tokens": 128, "chunk_tokens": 256, "workload": "mmlu", "started_at": LATER,
        "served_fingerprint": FINGERPRINT,
    }  # fmt: skip
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return path


def test_bench_vllm_graded_admit_writes_the_decisions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvsplice.cli import main

    report = _report_file(tmp_path, _all_configs())
    policy = tmp_path / "policy.json"
    rule = _committed_rule(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["bench", "vllm-graded", str(report), "--admit", str(policy), "--rule", str(rule)])
    assert exited.value.code in (0, None)
    assert "admits naive for " + FINGERPRINT in capsys.readouterr().out
    decisions = {d["config"]: d for d in json.loads(policy.read_text())["decisions"]}
    assert not decisions["control-unrotated"]["admitted"] and decisions["kvsplice"]["admitted"]
    assert (
        not decisions["control-noise"]["admitted"] and set(decisions["kvsplice"]) >= DECISION_KEYS
    )
    with pytest.raises(SystemExit) as exited:  # the committed rule, judged against old runs
        main(["bench", "vllm-graded", str(report), "--admit", str(policy), "--rule",
              str(tmp_path / "missing.json")])  # fmt: skip
    assert exited.value.code == 1 and "cannot decide admission" in capsys.readouterr().err


def test_the_reports_must_have_served_one_model() -> None:
    one = {"served_fingerprint": FINGERPRINT, "model_dir": "/m", "dtype": "float32"}
    assert va.report_fingerprint([one, one]) == FINGERPRINT
    other = {**one, "served_fingerprint": "kvfp1-" + "00" * 16}
    with pytest.raises(ValueError, match="different models"):
        va.report_fingerprint([one, other])


def test_calibration_grades_the_rules_draw_not_problems_picked_by_hand(tmp_path: Path) -> None:
    """The draw is seeded, nested (runs grow it by slices), leaves the held-out problems out;
    `--admit` refuses a calibration whose problems are not the draw's head, even one swap."""
    rule = _rule()
    draw = rule.calibration_draw("mmlu", 14_042, 300)
    assert draw[:150] == rule.calibration_draw("mmlu", 14_042, 150) == DRAW[:150]
    assert len(set(draw)) == 300 and not set(draw) & rule.held_out("mmlu", 14_042)
    assert draw != sorted(draw) and draw != rule.calibration_draw("mmlu", 14_042, 300)[::-1]
    policy, _ = va.admit(_reports(), _pooled(_all_configs()), FINGERPRINT, rule,
                         _committed_rule(tmp_path / "a"))  # fmt: skip
    assert "naive" in policy.admitted_modes
    swapped = _pooled(_all_configs())
    for row in swapped["configs"]:  # problem 150 of the draw graded instead of problem 0
        row["graded"]["runs"][0]["problem"] = f"mmlu-test-{draw[150]}"
    with pytest.raises(ValueError, match="outside the rule's draw"):
        va.admit(_reports(), swapped, FINGERPRINT, rule, _committed_rule(tmp_path / "b"))


def test_bench_yardstick_draw_prints_the_next_slice(capsys: pytest.CaptureFixture[str]) -> None:
    from kvsplice.cli import main

    for args, expected in (
        (["--count", "5"], DRAW[:5]),
        (["--count", "3", "--skip", "5"], DRAW[5:8]),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["bench", "yardstick-draw", "mmlu", *args])
        assert exited.value.code in (0, None)
        assert capsys.readouterr().out.strip() == ",".join(map(str, expected))
