"""Judge probes: the decision-error bound, the guard's replay, and admission for judges."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.eval.measure.jcr import JudgeRecord
from kvsplice.eval.measure.judge_probes import (
    JudgeThresholds,
    calibrated_margin,
    folds,
    guard,
    held_out_replay,
    judge_probe,
    margin_error,
    staged_pass_kept,
    staged_probes,
    staged_replay,
)

AGENTS = ("1", "2", "3", "4")


def _record(cheap: tuple[float, ...], dense: tuple[float, ...], reused: int = 600) -> JudgeRecord:
    """A judge record whose reads follow the label logits (order = agent ids)."""
    top = max(range(4), key=lambda j: cheap[j])
    dense_top = max(range(4), key=lambda j: dense[j])
    margin = cheap[top] - max(c for j, c in enumerate(cheap) if j != top)
    dense_margin = dense[dense_top] - max(d for j, d in enumerate(dense) if j != dense_top)
    return JudgeRecord(
        example_id="e", task="gsm8k", mode="crossfix", order=AGENTS, agent_id=AGENTS[top],
        slot=top, margin=margin, parsed_agent_id=None, dense_agent_id=AGENTS[dense_top],
        dense_slot=dense_top, dense_margin=dense_margin, dense_parsed_agent_id=None,
        ttft_s=1.0, dense_ttft_s=1.0, num_prompt_tokens=100, num_reused_tokens=40,
        num_candidate_tokens=40, num_candidate_token_layers_reused=reused, num_layers=30,
        scores=cheap, dense_scores=dense,
    )  # fmt: skip


logits = st.tuples(*[st.floats(-5, 5, allow_nan=False)] * 4)


@given(logits, logits)
def test_a_margin_above_the_error_means_dense_chose_the_same(cheap, dense) -> None:
    record = _record(cheap, dense)
    if record.margin > margin_error(record) + 1e-9:
        assert record.consistent


def test_margin_error_is_the_largest_pairwise_shift() -> None:
    record = _record((3.0, 1.0, 0.0, 0.5), (2.0, 1.5, 0.0, 0.5))
    # top is slot 0: shifts (2 - 0.5), (3 - 2), (2.5 - 1.5)
    assert margin_error(record) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="label logits"):
        margin_error(replace(record, scores=()))


def test_guard_replays_rejected_calls_as_dense() -> None:
    confident_wrong = _record((4.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0, 0.0))
    unsure_wrong = _record((1.1, 1.0, 0.0, 0.0), (1.0, 1.1, 0.0, 0.0))
    right = _record((2.0, 0.0, 0.0, 0.0), (2.0, 0.0, 0.0, 0.0), reused=300)
    records = [confident_wrong, unsure_wrong, right]
    assert guard(records, 0.0) == pytest.approx((1 / 3, 1.0, (0.5 + 0.5 + 0.25) / 3))
    assert guard(records, 0.5) == pytest.approx((2 / 3, 2 / 3, (0.5 + 0.25) / 3))
    assert guard(records, 5.0) == pytest.approx((1.0, 0.0, 0.0))


def test_calibrated_margin_covers_every_flip_and_nothing_else() -> None:
    # a confident call that moved a lot but chose the same needs no guard
    moved = _record((9.0, 0.0, 0.0, 0.0), (5.0, 0.0, 0.0, 0.0))
    assert margin_error(moved) == pytest.approx(4.0)
    assert calibrated_margin([moved], JudgeThresholds()) == 0.0
    flip = _record((1.2, 0.7, 0.0, 0.0), (0.9, 1.0, 0.0, 0.0))  # margin 0.5, flipped
    assert not flip.consistent
    assert calibrated_margin([moved, flip], JudgeThresholds()) == pytest.approx(0.65)  # 0.625
    # never at the flipped margin itself: that call would keep its prefill
    assert calibrated_margin([flip], JudgeThresholds(margin_safety=1.0)) == pytest.approx(0.55)
    at_zero = _record((1.0, 1.0, 0.0, 0.0), (0.9, 1.0, 0.0, 0.0))
    assert calibrated_margin([at_zero], JudgeThresholds()) == pytest.approx(0.05)


def test_the_held_out_replay_guards_each_fold_with_the_other_s_margin() -> None:
    # example a flips at margin 0.5; example b flips at 0.1 and keeps a right call at 0.3
    a = [replace(_record((1.5, 1.0, 0.0, 0.0), (1.0, 1.5, 0.0, 0.0)), example_id="a")]
    b = [
        replace(_record((1.1, 1.0, 0.0, 0.0), (1.0, 1.1, 0.0, 0.0)), example_id="b"),
        replace(_record((1.3, 1.0, 0.0, 0.0), (1.3, 1.0, 0.0, 0.0)), example_id="b"),
    ]
    assert folds(a + b) == ([0], [1, 2])
    # fold a under b's guard (0.15): its flip at 0.5 is kept; fold b under a's (0.65): dense
    jcr, kept, reuse = held_out_replay((a + b,), JudgeThresholds())
    assert (jcr, kept) == pytest.approx((2 / 3, 1 / 3))
    assert reuse == pytest.approx(0.5 / 3)
    # in sample, the guard (0.65) hides every flip: what admission must not read
    assert guard(a + b, calibrated_margin(a + b, JudgeThresholds()))[0] == 1.0
    with pytest.raises(ValueError, match="same"):
        held_out_replay((a + b, a), JudgeThresholds())


def test_admitted_only_when_the_held_out_jcr_clears_the_bar_with_some_reuse() -> None:
    stable = [
        replace(_record((3.0, 0.0, 0.0, 0.0), (2.9, 0.0, 0.0, 0.0)), example_id=f"s{i}")
        for i in range(8)
    ]
    flips = [
        replace(_record((1.1, 1.0, 0.0, 0.0), (1.0, 1.1, 0.0, 0.0)), example_id=f"f{i}")
        for i in range(2)
    ]
    # one flip per fold at margin 0.1: each fold's guard (0.15) sends the other's flip dense
    probe = judge_probe("crossfix", "crossfix:margin=0", flips + stable, JudgeThresholds())
    assert probe.min_margin == pytest.approx(0.15)
    assert probe.raw_jcr == pytest.approx(0.8)
    assert (probe.jcr, probe.kept) == pytest.approx((1.0, 0.8))
    assert probe.admitted
    # a flip only one fold saw is not caught in the other: held out, it counts
    lone = judge_probe("crossfix", "x", flips[:1] + stable, JudgeThresholds())
    assert lone.jcr == pytest.approx(8 / 9) and not lone.admitted
    nothing = [replace(r, num_candidate_token_layers_reused=0) for r in stable]
    assert not judge_probe("crossfix", "x", nothing, JudgeThresholds()).admitted


def test_staged_replay_keeps_the_cheap_pass_then_the_deep_one_then_dense() -> None:
    # call 0: cheap pass confident and right; call 1: cheap unsure, deep confident and right;
    # call 2: both unsure (one of them wrong): dense, consistent with nothing reused
    cheap = [
        replace(_record((3.0, 0.0, 0.0, 0.0), (3.0, 0.0, 0.0, 0.0), reused=720), example_id="a"),
        replace(_record((1.1, 1.0, 0.0, 0.0), (1.0, 1.1, 0.0, 0.0), reused=720), example_id="b"),
        replace(_record((1.1, 1.0, 0.0, 0.0), (1.0, 1.1, 0.0, 0.0), reused=720), example_id="c"),
    ]
    deep = [
        replace(_record((3.0, 0.0, 0.0, 0.0), (3.0, 0.0, 0.0, 0.0), reused=240), example_id="a"),
        replace(_record((0.0, 2.0, 0.0, 0.0), (1.0, 1.1, 0.0, 0.0), reused=240), example_id="b"),
        replace(_record((1.05, 1.0, 0.0, 0.0), (1.0, 1.1, 0.0, 0.0), reused=240), example_id="c"),
    ]
    jcr, kept, reuse = staged_replay(cheap, deep, (1.0, 0.5))
    assert jcr == 1.0 and kept == pytest.approx(2 / 3)
    assert reuse == pytest.approx((720 + 240) / 1200 / 3)
    # with no guard on the cheap pass its two flips count
    assert staged_replay(cheap, deep, (0.0, 0.5))[0] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="differ"):
        staged_replay(cheap, deep[::-1], (1.0, 0.5))
    # the cheap pass keeps a (1 of 3), the deep one b of the two it sees (1 of 2)
    assert staged_pass_kept(cheap, deep, (1.0, 0.5)) == (pytest.approx(1 / 3), 0.5)
    assert staged_pass_kept(cheap, deep, (0.0, 0.5)) == (1.0, 0.0)


def test_staged_probes_pair_a_cheaper_check_with_a_deeper_one_only() -> None:
    right = _record((3.0, 0.0, 0.0, 0.0), (3.0, 0.0, 0.0, 0.0))
    records = {"crossfix:check=12+margin=0": [right], "crossfix:check=24+margin=0": [right]}
    checks = {"crossfix:check=12+margin=0": 12, "crossfix:check=24+margin=0": 24}
    thresholds = JudgeThresholds()
    singles = [judge_probe("crossfix", spec, recs, thresholds) for spec, recs in records.items()]
    staged = staged_probes(singles, records, checks, thresholds)
    assert [p.spec for p in staged] == [
        f"crossfix:check=12+deep=24+deep_margin={singles[1].min_margin:g}+margin=0"
    ]
    assert staged[0].min_margin == singles[0].min_margin and staged[0].admitted
    # a parameter the probes set (calibration's judge variant) stays in the two-pass spec
    asking = {spec.replace("+margin", "+q=1+margin"): recs for spec, recs in records.items()}
    asking_checks = {spec.replace("+margin", "+q=1+margin"): c for spec, c in checks.items()}
    asking_singles = [judge_probe("crossfix", s, recs, thresholds) for s, recs in asking.items()]
    with_question = staged_probes(asking_singles, asking, asking_checks, thresholds)
    assert [p.spec for p in with_question] == [
        f"crossfix:check=12+deep=24+deep_margin={singles[1].min_margin:g}+q=1+margin=0"
    ]
