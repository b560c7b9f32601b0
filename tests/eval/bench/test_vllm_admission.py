"""Admitting an engine's `naive` by graded answers: the rule, the policy it writes, the
held-out confirmation, and `bench vllm-graded --admit/--held-out`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvsplice.client.modes.admission import AdmissionPolicy, GradedAccuracy
from kvsplice.eval.bench import vllm_admission as va
from kvsplice.integrations.vllm.reuse_policy import admits_spans

FINGERPRINT = "kvfp1-" + "ab" * 16
ROLES = ("solver", "reviser", "judge")
GATED = "kvsplice-gated (apc on)"


def _runs(rights: list[tuple[bool, bool, bool]], first: int = 0) -> list[dict[str, Any]]:
    return [
        {"problem": f"HumanEval/{first + i}", "right": dict(zip(ROLES, r, strict=True))}
        for i, r in enumerate(rights)
    ]


def _pooled(
    recompute: list[tuple[bool, bool, bool]], gated: list[tuple[bool, bool, bool]], first: int = 0
) -> dict[str, Any]:
    """`vllm_graded.pool`'s shape, as far as admission reads it."""
    return {
        "configs": [
            {"label": "recompute", "graded": {"runs": _runs(recompute, first)}},
            {"label": GATED, "graded": {"runs": _runs(gated, first)}},
        ]
    }


SAME = [(False, False, True)] * 100 + [(True, True, True)] * 20  # 360 answers alike


def _rule() -> va.AdmissionRule:
    return va.AdmissionRule(tolerance_points=2.0, min_answers=300)


def _admitted(pooled: dict[str, Any]) -> va.Verdict:
    return va.judge(va.evidence(pooled, va.gated_label(pooled), _rule(), "test"), _rule())


def test_answers_alike_admit_naive_and_the_engine_reads_the_policy(tmp_path: Path) -> None:
    verdict = _admitted(_pooled(SAME, SAME))
    assert verdict.admitted, verdict.reason
    e = verdict.evidence
    assert (e.both, e.mode_only, e.recompute_only, e.neither, e.num_answers) == (
        160, 0, 0, 200, 360
    )  # fmt: skip
    assert -2 < e.ci95_points[0] < 0 < e.ci95_points[1] < 2 and e.points == 0
    policy = va.admission_policy(FINGERPRINT, verdict)
    path = tmp_path / "policy.json"
    path.write_text(policy.to_json())
    again = AdmissionPolicy.from_json(path.read_text())
    assert again == policy and again.graded["naive"].problems[-1] == "HumanEval/119"
    assert admits_spans(str(path), FINGERPRINT)  # the connector admits naive from it


def test_a_mode_that_may_lose_more_than_the_tolerance_is_not_admitted(tmp_path: Path) -> None:
    # gated loses the judge's verdict on 6 of 120 problems: -1.7 points, but the
    # interval reaches below -2: the engine's policy admits exact only
    worse = [(False, False, False)] * 6 + SAME[6:]
    verdict = _admitted(_pooled(SAME, worse))
    assert not verdict.admitted and "may lose more than 2 points" in verdict.reason
    assert verdict.evidence.points == pytest.approx(-100 * 6 / 360)
    path = tmp_path / "policy.json"
    path.write_text(va.admission_policy(FINGERPRINT, verdict).to_json())
    assert not admits_spans(str(path), FINGERPRINT)
    # too few answers is no evidence, however alike
    few = _admitted(_pooled(SAME[:50], SAME[:50]))
    assert not few.admitted and "150 graded answers < 300" in few.reason


def test_held_out_runs_confirm_or_refuse_an_admission() -> None:
    policy = va.admission_policy(FINGERPRINT, _admitted(_pooled(SAME, SAME)))
    alike = SAME[:40]
    verdict, together = va.confirm(
        _pooled(alike, alike, first=200), policy, FINGERPRINT, GATED, _rule()
    )
    assert verdict.admitted, verdict.reason
    assert together.num_answers == 360 + 120 and len(together.problems) == 160
    # held-out runs that lose a third of their answers refuse it
    lost = [(False, False, False)] * 40
    verdict, _ = va.confirm(_pooled(alike, lost, first=200), policy, FINGERPRINT, GATED, _rule())
    assert not verdict.admitted and "loses more than the tolerance" in verdict.reason
    with pytest.raises(ValueError, match=r"not held out: .*HumanEval/10"):
        va.confirm(_pooled(alike, alike, first=10), policy, FINGERPRINT, GATED, _rule())
    with pytest.raises(ValueError, match="served kvfp1-00"):
        va.confirm(_pooled(alike, alike, 200), policy, "kvfp1-" + "00" * 16, GATED, _rule())
    refused = va.admission_policy(FINGERPRINT, _admitted(_pooled(SAME[:10], SAME[:10])))
    with pytest.raises(ValueError, match="does not admit naive"):
        va.confirm(_pooled(alike, alike, 200), refused, FINGERPRINT, GATED, _rule())


def test_the_judged_configuration_must_be_unambiguous() -> None:
    pooled = _pooled(SAME[:2], SAME[:2])
    pooled["configs"].append({"label": "kvsplice-gated (apc off)", "graded": {"runs": []}})
    with pytest.raises(ValueError, match="--config"):
        va.gated_label(pooled)
    assert va.gated_label(pooled, "kvsplice-gated (apc off)") == "kvsplice-gated (apc off)"
    with pytest.raises(ValueError, match="no configuration 'lmcache'"):
        va.gated_label(pooled, "lmcache")


def test_graded_accuracy_checks_its_figures() -> None:
    with pytest.raises(ValueError, match="outside its interval"):
        GradedAccuracy(1, 0, 0, 1, 5.0, (-1.0, 1.0), ("P/1",), 2.0, "w")
    with pytest.raises(ValueError, match=">= 0"):
        GradedAccuracy(1, -1, 0, 1, 0.0, (-1.0, 1.0), ("P/1",), 2.0, "w")
    with pytest.raises(ValueError, match="tolerance_points"):
        GradedAccuracy(1, 0, 0, 1, 0.0, (-1.0, 1.0), ("P/1",), -2.0, "w")


def _report(tmp_path: Path, name: str, first: int, count: int, gated_lost: int = 0) -> Path:
    """A `bench vllm --problems` report's JSON, as far as pooling and admission read it."""
    recompute = _runs(SAME[:count], first)
    gated = _runs([(False, False, False)] * gated_lost + SAME[gated_lost:count], first)
    graded = lambda runs: {"runs": runs, "outputs_equal_recompute": 0, "outputs": 0}  # noqa: E731
    report = {
        "configs": [
            {"label": "recompute", "graded": graded(recompute)},
            {"label": GATED, "graded": graded(gated)},
        ],
        "model_dir": "/models/m", "dtype": "float32", "layout": "persona-first",
        "answer_tokens": 160, "chunk_tokens": 256, "served_fingerprint": FINGERPRINT,
    }  # fmt: skip
    for row in report["configs"]:
        row["graded"]["roles"] = {}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(report))
    return path


def test_bench_vllm_graded_admits_then_confirms_on_held_out_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvsplice.cli import main

    calibration = [_report(tmp_path, "a", 0, 60), _report(tmp_path, "b", 60, 60)]
    policy = tmp_path / "policy.json"
    with pytest.raises(SystemExit) as exited:
        main(["bench", "vllm-graded", *map(str, calibration), "--admit", str(policy)])
    assert exited.value.code in (0, None)
    assert "admits naive for " + FINGERPRINT in capsys.readouterr().out
    assert admits_spans(str(policy), FINGERPRINT)
    held_out = _report(tmp_path, "c", 200, 40)
    out_json = tmp_path / "held-out.json"
    with pytest.raises(SystemExit) as exited:
        main(["bench", "vllm-graded", str(held_out), "--held-out", str(policy),
              "--json", str(out_json)])  # fmt: skip
    assert exited.value.code in (0, None)
    assert f"held out: confirms {policy}" in capsys.readouterr().out
    admission = json.loads(out_json.read_text())["admission"]
    assert admission["held_out"]["admitted"] and admission["with_calibration"]["answers"] == 480
    # the calibration's own problems are not held out: a clear error, exit 1
    with pytest.raises(SystemExit) as exited:
        main(["bench", "vllm-graded", str(calibration[0]), "--held-out", str(policy)])
    assert exited.value.code == 1
    assert "not held out" in capsys.readouterr().err


def test_the_reports_must_have_served_one_model() -> None:
    one = {"served_fingerprint": FINGERPRINT, "model_dir": "/m", "dtype": "float32"}
    assert va.report_fingerprint([one, one]) == FINGERPRINT
    other = {**one, "served_fingerprint": "kvfp1-" + "00" * 16}
    with pytest.raises(ValueError, match="different models"):
        va.report_fingerprint([one, other])
