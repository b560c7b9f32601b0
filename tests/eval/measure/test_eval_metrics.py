"""Aggregates of hand-built call records (exact numbers) and fidelity of hand-built logits."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.evaluation import make_record
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.eval.measure.fidelity import Reference, compare, kl_divergence
from kvsplice.eval.measure.metrics import aggregate, by_sample, decision_counts, pipeline_speedup
from kvsplice.eval.report.results import sample_rows


def make_records() -> list:
    """dense: pos1 TTFT 1,2,3 s; pos2 4,4 s. exact: pos1 1,1 s; pos2 0.5,1.5,2 s."""
    dense = [make_record(ttft_s=t) for t in (1.0, 2.0, 3.0)]
    dense += [make_record(position=2, agent_id="2", ttft_s=4.0, correct=c) for c in (True, False)]
    exact = [
        make_record(mode="exact", ttft_s=1.0, num_reused_tokens=50, first_token_agrees=True,
                    kl_dense_reuse=0.1, output_matches=True),
        make_record(mode="exact", ttft_s=1.0, first_token_agrees=False, kl_dense_reuse=0.3,
                    output_matches=False),
    ]  # fmt: skip
    exact += [
        make_record(mode="exact", position=2, agent_id="2", ttft_s=t, num_prompt_tokens=200,
                    num_reused_tokens=200 if t < 1 else 100, correct=t < 1)
        for t in (0.5, 1.5, 2.0)
    ]  # fmt: skip
    return dense + exact


def test_per_position_ttft_speedup_and_reuse_rates() -> None:
    aggregates = aggregate(make_records())
    exact1, exact2 = aggregates.at("exact", 1), aggregates.at("exact", 2)
    assert exact1 is not None and exact2 is not None
    assert (exact1.num_calls, exact1.mean_ttft_s, exact1.median_ttft_s) == (2, 1.0, 1.0)
    assert exact1.speedup == pytest.approx(2.0)  # dense median 2 s / exact median 1 s
    assert exact1.token_reuse_rate == pytest.approx(50 / 200)
    assert exact1.call_reuse_rate == pytest.approx(0.5)
    assert exact2.median_ttft_s == 1.5
    assert exact2.speedup == pytest.approx(4.0 / 1.5)
    assert exact2.token_reuse_rate == pytest.approx(400 / 600)
    assert exact2.call_reuse_rate == 1.0


def test_per_mode_speedup_is_sum_of_position_medians() -> None:
    aggregates = aggregate(make_records())
    exact = aggregates.at("exact")
    assert exact is not None and exact.position is None
    assert exact.speedup == pytest.approx((2.0 + 4.0) / (1.0 + 1.5))
    assert exact.num_calls == 5
    assert exact.mean_ttft_s == pytest.approx((1 + 1 + 0.5 + 1.5 + 2) / 5)
    assert exact.mean_prompt_tokens == pytest.approx((100 + 100 + 600) / 5)
    dense = aggregates.at("dense")
    assert dense is not None and dense.speedup == pytest.approx(1.0)


def test_fidelity_and_accuracy_count_only_present_values() -> None:
    aggregates = aggregate(make_records())
    exact = aggregates.at("exact")
    assert exact is not None
    assert exact.first_token_agreement == pytest.approx(0.5)
    assert exact.mean_kl == pytest.approx(0.2)
    assert exact.max_kl == pytest.approx(0.3)
    assert exact.output_match == pytest.approx(0.5)
    assert (exact.accuracy, exact.num_scored) == (pytest.approx(1 / 3), 3)
    dense = aggregates.at("dense")
    assert dense is not None
    assert (dense.accuracy, dense.num_scored) == (0.5, 2)
    assert dense.first_token_agreement is None and dense.mean_kl is None


def test_modes_keep_first_seen_order_and_positions_are_sorted() -> None:
    aggregates = aggregate(list(reversed(make_records())))
    assert [g.mode for g in aggregates.by_mode] == ["exact", "dense"]
    assert [(g.mode, g.position) for g in aggregates.by_position] == [
        ("exact", 1), ("exact", 2), ("dense", 1), ("dense", 2),
    ]  # fmt: skip


def test_speedup_is_none_without_dense_at_that_position() -> None:
    records = [make_record(mode="naive", position=3, ttft_s=1.0)]
    aggregates = aggregate(records)
    naive = aggregates.at("naive", 3)
    assert naive is not None and naive.speedup is None
    assert pipeline_speedup(records, {1: 2.0}) is None


def test_token_layer_reuse_counts_each_span_at_its_reused_layers() -> None:
    """30 layers: a whole span (40 tok × 30), a half-depth span (20 tok × 16), an old span (× 0)."""
    whole = {"name": "a", "num_tokens": 40, "num_layers": 30}
    lower = {"name": "b", "num_tokens": 20, "num_layers": 16}
    old = {"name": "c", "num_tokens": 50}
    first = make_record(mode="multicut:cut=16", num_layers=30, num_reused_tokens=60,
                        reused_spans=(whole, lower))  # fmt: skip
    second = make_record(mode="multicut:cut=16", num_layers=30, num_prompt_tokens=200,
                         num_reused_tokens=50, reused_spans=(old,))  # fmt: skip
    assert first.num_reused_token_layers == 40 * 30 + 20 * 16
    assert first.num_prompt_token_layers == 100 * 30
    assert second.num_reused_token_layers == 0
    group = aggregate([make_record(num_layers=30), first, second]).at("multicut:cut=16")
    assert group is not None
    assert group.token_layer_reuse_rate == pytest.approx((40 * 30 + 20 * 16) / (300 * 30))
    assert group.token_reuse_rate == pytest.approx(110 / 300)


def test_token_layer_reuse_leaves_out_records_without_a_layer_count() -> None:
    span = {"name": "a", "num_tokens": 40, "num_layers": 30}
    unknown = make_record(mode="naive", num_reused_tokens=40, reused_spans=(span,))
    known = make_record(mode="naive", num_layers=30, num_reused_tokens=40, reused_spans=(span,))
    assert aggregate([unknown]).by_mode[0].token_layer_reuse_rate is None
    assert aggregate([unknown, known]).by_mode[0].token_layer_reuse_rate == pytest.approx(0.4)
    with pytest.raises(ValueError, match="num_layers"):
        make_record(num_layers=-1)


def test_record_rejects_more_reused_than_prompt_tokens() -> None:
    with pytest.raises(ValueError, match="num_reused_tokens"):
        make_record(num_reused_tokens=101)


def test_record_to_dict_is_json_ready() -> None:
    record = make_record(
        timings_s={"prefill_s": 0.5}, reused_spans=({"name": "q", "num_tokens": 3},)
    )
    data = record.to_dict()
    assert data["timings_s"] == {"prefill_s": 0.5}
    assert data["reused_spans"] == [{"name": "q", "num_tokens": 3}]
    assert record.reuse_rate == 0.0


def test_kl_of_two_point_distributions_matches_closed_form() -> None:
    p = torch.log(torch.tensor([0.5, 0.5]))
    q = torch.log(torch.tensor([0.25, 0.75]))
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl_divergence(p, q) == pytest.approx(expected, rel=1e-6)  # fp32 inputs


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 64), st.floats(-5, 5), st.integers(0, 2**16))
def test_kl_is_zero_for_shifted_logits(vocab: int, shift: float, seed: int) -> None:
    """Softmax ignores a constant shift: KL(p ‖ p + c) = 0."""
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed))
    assert kl_divergence(logits, logits + shift) == pytest.approx(0.0, abs=1e-9)


def test_compare_reports_agreement_gap_and_output_match() -> None:
    reference = Reference(torch.tensor([0.0, 2.0, 1.0]), (1, 2, 3), ttft_s=0.1)
    same = compare(reference, torch.tensor([0.0, 2.0, 1.0]), [1, 2, 3])
    assert (same.first_token_agrees, same.kl_dense_reuse, same.max_abs_logit_diff) == (
        True,
        0.0,
        0.0,
    )
    assert same.output_matches is True
    other = compare(reference, torch.tensor([0.0, 1.0, 3.0]), [2])
    assert other.first_token_agrees is False
    assert other.max_abs_logit_diff == pytest.approx(2.0)
    assert other.output_matches is False
    assert other.kl_dense_reuse > 0
    logits_only = compare(Reference(torch.zeros(3), None, 0.1), torch.zeros(3), [1])
    assert logits_only.output_matches is None


def test_decision_counts_group_each_policy_verdict() -> None:
    records = [
        make_record(mode="anchor", decisions={"anchor_gate": "ambiguous"}),
        make_record(mode="anchor", decisions={"anchor_gate": "confident"}),
        make_record(mode="anchor", decisions={"anchor_gate": "ambiguous"}),
        make_record(mode="anchor"),
    ]
    assert decision_counts(records) == {"anchor_gate=ambiguous": 2, "anchor_gate=confident": 1}
    (stats,) = aggregate(records).by_mode
    assert stats.decision_counts == {"anchor_gate=ambiguous": 2, "anchor_gate=confident": 1}
    assert records[0].to_dict()["decisions"] == {"anchor_gate": "ambiguous"}


def test_by_sample_shows_reuse_growing_per_mode_and_sample() -> None:
    records = [
        make_record(mode="dense", sample_index=0),
        make_record(mode="anchor", sample_index=1, num_reused_tokens=60, first_token_agrees=False,
                    kl_dense_reuse=0.3),
        make_record(mode="anchor", sample_index=0, num_reused_tokens=10, first_token_agrees=True,
                    kl_dense_reuse=0.0),
        make_record(mode="anchor", sample_index=1, position=2, num_reused_tokens=20,
                    first_token_agrees=True, kl_dense_reuse=0.1),
    ]  # fmt: skip
    stats = by_sample(records)
    assert [(s.mode, s.sample_index, s.num_calls) for s in stats] == [
        ("dense", 0, 1), ("anchor", 0, 1), ("anchor", 1, 2),
    ]  # fmt: skip
    late = stats[2]
    assert late.token_reuse_rate == pytest.approx(0.4)
    assert late.first_token_agreement == 0.5 and late.mean_kl == pytest.approx(0.2)
    headers, rows = sample_rows(records)
    assert headers == ["mode", "sample 1", "sample 2"]
    assert rows == [("dense", "0% · -", "-"), ("anchor", "10% · 100%", "40% · 50%")]
