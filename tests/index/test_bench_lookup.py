"""The lookup benchmark: deterministic workloads and well-formed reports (no timing asserts)."""

from __future__ import annotations

import itertools

import pytest

from kvsplice.index.bench_lookup import make_workload, measure_lookup_latency


def test_workload_is_deterministic_and_chained() -> None:
    a = make_workload(10, segment_tokens=16, segments_per_chain=4, seed=3)
    b = make_workload(10, segment_tokens=16, segments_per_chain=4, seed=3)
    assert a.metas == b.metas
    assert [len(chain) for chain in a.chains] == [4, 4, 2]
    for chain in a.chains:
        for previous, meta in itertools.pairwise(chain):
            assert meta.parent_key == previous.context_key
            assert meta.start_position == previous.end_position
            assert meta.left_tail_ids[-16:] == previous.token_ids


@pytest.mark.parametrize(
    ("kind", "with_text"), [("exact", True), ("similarity", True), ("similarity", False)]
)
def test_report_finds_every_stored_target(kind: str, with_text: bool) -> None:
    report = measure_lookup_latency(
        60,
        kind=kind,
        segment_tokens=128,
        with_text=with_text,
        num_queries=40,
        measure_signed_rebuild=kind == "similarity",
    )
    assert (report.kind, report.num_segments, report.num_queries) == (kind, 60, 40)
    # Text queries differ only in masked numbers; token-only queries alternate exact
    # (always found by content key) and 3-token edits (found with LSH recall < 1).
    assert (report.hit_rate == 1.0) if with_text else (report.hit_rate >= 0.5)
    assert 0 < report.p50_ms <= report.p99_ms <= report.max_ms
    assert report.adds_per_s > 0
    assert (report.signed_adds_per_s > 0) == (kind == "similarity")


def test_unknown_kind_is_rejected() -> None:
    with pytest.raises(ValueError, match="kind"):
        measure_lookup_latency(1, kind="fuzzy")
