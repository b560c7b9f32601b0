"""kvsplice's counters in vLLM's stats: interval deltas, vLLM's aggregation across halves and
workers, and the Prometheus families `build_prom_metrics` registers (a registry of its own)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="vLLM's stats classes (make vllm)")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvsplice.integrations.vllm.connector import KvspliceConnector
from kvsplice.integrations.vllm.connector_stats import FIELDS, KvspliceConnectorStats, interval


def test_an_interval_carries_counter_deltas_and_the_gauges_latest_value() -> None:
    first = interval({"loaded_tokens": 256, "lookups": 3, "breaker_open": 1}, {})
    assert first.data["loaded_tokens"] == 256 and first.data["breaker_open"] == 1
    later = interval({"loaded_tokens": 256, "lookups": 3}, {"loaded_tokens": 256, "lookups": 3})
    assert later.is_empty()  # nothing new, breaker closed: vLLM skips it
    with pytest.raises(ValueError, match="unknown kvsplice stats"):
        KvspliceConnectorStats(data={"loaded_tokenz": 1})


def test_vllm_adds_the_halves_and_workers_up_and_rebuilds_them_from_their_dict() -> None:
    worker = interval({"loaded_tokens": 512, "stored_chunks": 2}, {})
    other_worker = interval({"loaded_tokens": 256, "failed_loads": 1}, {})
    scheduler = interval({"lookups": 4, "promised_exact_tokens": 768, "breaker_open": 0}, {})
    total = worker.aggregate(other_worker).aggregate(scheduler)
    reduced = total.reduce()
    assert reduced["loaded_tokens"] == 768 and reduced["failed_loads"] == 1
    assert reduced["lookups"] == 4 and reduced["promised_exact_tokens"] == 768
    rebuilt = KvspliceConnector.build_kv_connector_stats(total.to_dict())
    assert rebuilt is not None and rebuilt.reduce() == reduced and set(reduced) == set(FIELDS)
    assert KvspliceConnector.build_kv_connector_stats(None).is_empty()  # type: ignore[union-attr]


def test_the_prometheus_families_count_per_engine() -> None:
    registry = CollectorRegistry()
    types = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    metrics = KvspliceConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        types,
        ["model_name", "engine"],  # type: ignore[arg-type]
        {0: ["m", "0"], 1: ["m", "1"]},
    )
    metrics.observe(interval({"loaded_tokens": 256, "breaker_open": 1}, {}).data, engine_idx=1)
    metrics.observe(interval({"loaded_tokens": 128}, {}).data, engine_idx=1)
    page = generate_latest(registry).decode()
    assert 'vllm:kvsplice_loaded_tokens_total{engine="1",model_name="m"} 384.0' in page
    assert 'vllm:kvsplice_loaded_tokens_total{engine="0",model_name="m"} 0.0' in page
    assert 'vllm:kvsplice_breaker_open{engine="1",model_name="m"} 0.0' in page  # latest: closed
