"""StoreMetrics: names follow Prometheus conventions, labels stay bounded, values add up."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from kvsplice.server.metrics import DIRECTIONS, LOOKUP_KINDS, RESULTS, StoreMetrics
from kvsplice.server.store_collector import EVICTION_REASONS
from kvsplice.storage.store_stats import REMOVAL_REASONS, StoreStats, TierUsage
from kvsplice.storage.tier import TierStats

RPC_METHODS = ("Lookup", "Fetch", "Put")


def make_metrics() -> StoreMetrics:
    return StoreMetrics(rpc_methods=RPC_METHODS)


IDLE = TierStats()


def make_store_stats(
    memory: TierStats = IDLE, lmdb: TierStats = IDLE, **removals: int
) -> StoreStats:
    """A memory cache over a durable LMDB tier, as `TieredStore.stats()` reports them."""
    return StoreStats(
        tiers={"memory": memory, "lmdb": lmdb},
        total=memory + lmdb,
        num_segments=7,
        stored_bytes=12345,
        removals={reason: removals.get(reason, 0) for reason in REMOVAL_REASONS},
        usage={"memory": TierUsage(1000, 4096), "lmdb": TierUsage(20480, 1 << 20)},
        durable_tier="lmdb",
    )


def is_runtime_family(name: str) -> bool:
    """process_* and python_info come from prometheus_client's own collectors."""
    return name.startswith(("process_", "python_"))


def value(metrics: StoreMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def families(metrics: StoreMetrics) -> dict[str, object]:
    body, _ = metrics.render()
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def test_every_series_is_prefixed_and_counters_end_in_total() -> None:
    metrics = make_metrics()
    metrics.bind_store(make_store_stats)
    for family in metrics.registry.collect():
        assert family.name.startswith("kvsplice_") or is_runtime_family(family.name), family.name
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name.endswith("_total"), sample.name


def test_no_created_series_build_info_and_process_metrics() -> None:
    metrics = make_metrics()
    metrics.add_bytes("in", 1)
    text = metrics.render()[0].decode()
    assert "_created" not in text
    assert 'kvsplice_build_info{version="' in text
    assert value(metrics, "process_resident_memory_bytes") > 0
    assert value(metrics, "process_cpu_seconds_total") >= 0


def test_no_series_carries_a_namespace_label() -> None:
    metrics = make_metrics()
    metrics.record_lookup("exact", True, 10, 10)
    for family in metrics.registry.collect():
        for sample in family.samples:
            assert "namespace" not in sample.labels, sample.name


def test_known_label_combinations_start_at_zero() -> None:
    metrics = make_metrics()
    for kind in LOOKUP_KINDS:
        for result in RESULTS:
            assert value(metrics, "kvsplice_lookups_total", kind=kind, result=result) == 0
    metrics.bind_store(make_store_stats)
    for tier in ("memory", "lmdb"):
        assert value(metrics, "kvsplice_checksum_failures_total", tier=tier) == 0
        for reason in EVICTION_REASONS:
            assert value(metrics, "kvsplice_evictions_total", tier=tier, reason=reason) == 0
    for direction in DIRECTIONS:
        assert value(metrics, "kvsplice_bytes_total", direction=direction) == 0


def test_record_lookup_counts_lookups_and_tokens() -> None:
    metrics = make_metrics()
    metrics.record_lookup("exact", True, queried_tokens=100, hit_tokens=64)
    metrics.record_lookup("exact", False, queried_tokens=50, hit_tokens=0)
    metrics.record_lookup("similar", True, queried_tokens=30, hit_tokens=30)
    assert value(metrics, "kvsplice_lookups_total", kind="exact", result="hit") == 1
    assert value(metrics, "kvsplice_lookups_total", kind="exact", result="miss") == 1
    assert value(metrics, "kvsplice_lookups_total", kind="similar", result="hit") == 1
    assert value(metrics, "kvsplice_lookup_queried_tokens_total") == 180
    assert value(metrics, "kvsplice_lookup_matched_tokens_total") == 94


def test_payload_bytes_accumulate() -> None:
    metrics = make_metrics()
    metrics.add_bytes("in", 1000)
    metrics.add_bytes("out", 300)
    metrics.add_bytes("out", 200)
    assert value(metrics, "kvsplice_bytes_total", direction="in") == 1000
    assert value(metrics, "kvsplice_bytes_total", direction="out") == 500


def test_tier_counters_come_from_the_store_at_scrape_time() -> None:
    metrics = make_metrics()
    memory = TierStats(hits=5, misses=3, evictions=4, checksum_failures=1)
    lmdb = TierStats(hits=3, misses=0, evictions=99, checksum_failures=2)
    metrics.bind_store(lambda: make_store_stats(memory, lmdb, capacity=6, ttl=2, delete=8))
    assert value(metrics, "kvsplice_tier_requests_total", tier="memory", result="hit") == 5
    assert value(metrics, "kvsplice_tier_requests_total", tier="memory", result="miss") == 3
    assert value(metrics, "kvsplice_tier_requests_total", tier="lmdb", result="hit") == 3
    # A cache reports its own budget evictions and dropped corrupt records...
    assert value(metrics, "kvsplice_evictions_total", tier="memory", reason="capacity") == 4
    assert value(metrics, "kvsplice_evictions_total", tier="memory", reason="corrupt") == 1
    # ... the durable tier the store's removals; deletes are not evictions.
    assert value(metrics, "kvsplice_evictions_total", tier="lmdb", reason="capacity") == 6
    assert value(metrics, "kvsplice_evictions_total", tier="lmdb", reason="ttl") == 2
    assert value(metrics, "kvsplice_checksum_failures_total", tier="lmdb") == 2
    assert value(metrics, "kvsplice_tier_used_bytes", tier="lmdb") == 20480
    assert value(metrics, "kvsplice_tier_capacity_bytes", tier="memory") == 4096


def test_rpc_histogram_spans_a_tenth_of_a_millisecond_to_ten_seconds() -> None:
    metrics = make_metrics()
    metrics.observe_rpc("Lookup", 0.00005, "OK")
    metrics.observe_rpc("Lookup", 3.0, "OK")
    metrics.observe_rpc("Fetch", 0.002, "NOT_FOUND")
    count = value(metrics, "kvsplice_rpc_duration_seconds_count", method="Lookup", code="OK")
    assert count == 2
    first = value(
        metrics, "kvsplice_rpc_duration_seconds_bucket", method="Lookup", code="OK", le="0.0001"
    )
    assert first == 1
    last = value(
        metrics, "kvsplice_rpc_duration_seconds_bucket", method="Lookup", code="OK", le="10.0"
    )
    assert last == 2
    assert (
        value(metrics, "kvsplice_rpc_duration_seconds_count", method="Fetch", code="NOT_FOUND") == 1
    )


def test_segment_size_histogram_and_usage_gauges() -> None:
    metrics = make_metrics()
    metrics.observe_segment_size(3 * 1024 * 1024)
    metrics.bind_store(make_store_stats)
    assert value(metrics, "kvsplice_segment_size_bytes_count") == 1
    assert value(metrics, "kvsplice_segment_size_bytes_sum") == 3 * 1024 * 1024
    assert (
        value(metrics, "kvsplice_segment_size_bytes_bucket", le=floatToGoString(4 * 1024**2)) == 1
    )
    assert value(metrics, "kvsplice_segment_size_bytes_bucket", le=floatToGoString(1024**2)) == 0
    assert value(metrics, "kvsplice_segments") == 7
    assert value(metrics, "kvsplice_stored_bytes") == 12345


def test_bound_store_is_read_at_render_time() -> None:
    metrics = make_metrics()
    assert "kvsplice_segments" not in families(metrics)  # unbound: no store series
    stats = [make_store_stats()]
    metrics.bind_store(lambda: stats[-1])
    assert families(metrics)["kvsplice_segments"].samples[0].value == 7
    stats.append(make_store_stats(TierStats(hits=9)))
    rendered = families(metrics)
    hits = [s for s in rendered["kvsplice_tier_requests"].samples if s.labels["tier"] == "memory"]
    assert hits[0].value == 9


def test_render_is_prometheus_text_with_every_series() -> None:
    metrics = make_metrics()
    metrics.bind_store(make_store_stats)
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    names = set(families(metrics))
    assert {
        "kvsplice_lookups",
        "kvsplice_tier_requests",
        "kvsplice_hit_tokens",
        "kvsplice_prompt_tokens",
        "kvsplice_reported_calls",
        "kvsplice_segment_reads",
        "kvsplice_lookup_queried_tokens",
        "kvsplice_lookup_matched_tokens",
        "kvsplice_bytes",
        "kvsplice_evictions",
        "kvsplice_checksum_failures",
        "kvsplice_rpc_duration_seconds",
        "kvsplice_segments",
        "kvsplice_stored_bytes",
        "kvsplice_segment_size_bytes",
        "kvsplice_tier_used_bytes",
        "kvsplice_tier_capacity_bytes",
        "kvsplice_build_info",
    } <= names
    assert b"kvsplice_lookups_total" in body


def test_two_instances_do_not_share_a_registry() -> None:
    first, second = make_metrics(), make_metrics()
    first.add_bytes("in", 10)
    assert value(first, "kvsplice_bytes_total", direction="in") == 10
    assert value(second, "kvsplice_bytes_total", direction="in") == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.observe_rpc("lookup_for_user_42", 0.1, "OK"),
        lambda m: m.observe_rpc("Lookup", 0.1, "TEAPOT"),
        lambda m: m.observe_rpc("Lookup", -1.0, "OK"),
        lambda m: m.record_lookup("fuzzy", True, 1, 1),
        lambda m: m.record_lookup("exact", True, 5, 6),
        lambda m: m.record_lookup("exact", True, -1, 0),
        lambda m: m.add_bytes("sideways", 1),
        lambda m: m.add_bytes("in", -1),
        lambda m: m.observe_segment_size(-5),
    ],
)
def test_unbounded_or_invalid_values_are_rejected(call: Callable[[StoreMetrics], None]) -> None:
    metrics = make_metrics()

    def kvsplice_lines() -> list[str]:  # process_* values move on their own
        return [line for line in metrics.render()[0].decode().splitlines() if "kvsplice_" in line]

    before = kvsplice_lines()
    with pytest.raises(ValueError):
        call(metrics)
    assert kvsplice_lines() == before


@pytest.mark.parametrize("methods", [(), ("lookup",), ("Look up",), ("/kvsplice.Store/Lookup",)])
def test_rpc_method_set_must_be_rpc_names(methods: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        StoreMetrics(rpc_methods=methods)
