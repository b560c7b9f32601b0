"""kvsplice's counters in vLLM's own stats: its logged "KV Transfer metrics" and `/metrics`.

vLLM asks each connector (worker half after each step, scheduler half after it) for the
stats of the last interval (`get_kv_connector_stats`), adds them up across workers and
halves (`aggregate`), logs them (`reduce`) and hands them to the connector's Prometheus
metrics (`build_prom_metrics`): counters `vllm:kvsplice_<name>_total` and the gauge
`vllm:kvsplice_breaker_open`, per engine, beside vLLM's prefix-cache counters. Owns the
names and the arithmetic; reading the halves' totals is the connector's (`totals`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

# counter name -> what it counts (each a running total on its half; the stats carry deltas)
COUNTERS: dict[str, str] = {
    "lookups": "Prefix lookups the scheduler asked the sidecar.",
    "promised_exact_tokens": "Prompt tokens promised from exact chain links.",
    "promised_approximate_tokens": "Prompt tokens promised from approximate runs (gated requests).",
    "loaded_tokens": "Prompt tokens the workers wrote into KV blocks from the store.",
    "failed_lookups": "Lookups that timed out, were refused or failed (answered as a miss).",
    "failed_loads": "Loads that failed (their tokens recomputed).",
    "corrupt_loads": "Failed loads whose stored piece failed verification (deleted).",
    "missing_loads": "Failed loads whose promised segment was gone (evicted since the lookup).",
    "stored_chunks": "Chunks the sidecar acknowledged.",
    "failed_saves": "Chunk saves that failed or were refused.",
    "withheld_saves": "Chunks not saved because they were computed over a failed load.",
    "breaker_trips": "Times the sidecar circuit breaker opened.",
}
GAUGES: dict[str, str] = {"breaker_open": "1 while the sidecar circuit breaker is open."}
FIELDS = (*COUNTERS, *GAUGES)


@dataclass
class KvspliceConnectorStats(KVConnectorStats):
    """One interval's deltas of `COUNTERS` and the latest `GAUGES` (`data`, by name)."""

    data: dict[str, Any] = field(default_factory=dict)  # vLLM's field, typed for mypy

    def __post_init__(self) -> None:
        unknown = sorted(set(self.data) - set(FIELDS))
        if unknown:
            raise ValueError(f"unknown kvsplice stats {unknown}")
        self.data = {name: self.data.get(name, 0) for name in FIELDS}

    def reset(self) -> None:
        self.data = dict.fromkeys(FIELDS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            mine = self.data.get(name, 0)
            self.data[name] = max(mine, value) if name in GAUGES else mine + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def interval(totals: Mapping[str, int], seen: Mapping[str, int]) -> KvspliceConnectorStats:
    """The stats since `seen` (the totals at the last call): counters' deltas, gauges' values."""
    data = {name: totals.get(name, 0) - seen.get(name, 0) for name in COUNTERS}
    data.update({name: totals.get(name, 0) for name in GAUGES})
    return KvspliceConnectorStats(data=data)


class KvsplicePromMetrics(KVConnectorPromMetrics):
    """`vllm:kvsplice_*` in vLLM's Prometheus registry, one child per engine."""

    def __init__(
        self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
    ) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._family(self._counter_cls, name, text) for name, text in COUNTERS.items()
        }
        self._gauges = {
            name: self._family(self._gauge_cls, name, text, multiprocess_mode="mostrecent")
            for name, text in GAUGES.items()
        }

    def _family(self, kind: Any, name: str, text: str, **extra: Any) -> dict[int, Any]:
        """`vllm:kvsplice_<name>` registered once, its child per engine."""
        metric = kind(
            name=f"vllm:kvsplice_{name}", documentation=text, labelnames=self._labelnames, **extra
        )
        return self._per_engine(metric)

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, children in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value > 0:
                children[engine_idx].inc(value)
        for name, children in self._gauges.items():
            if name in transfer_stats_data:
                children[engine_idx].set(transfer_stats_data[name])
