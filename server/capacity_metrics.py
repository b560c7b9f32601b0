"""Prometheus series of capacity pressure per namespace: evictions and refused puts.

A collector read at scrape time from `TieredStore.namespace_pressure` (counters the
store keeps), so nothing here is counted twice. Namespace labels are bounded by the
tenants an operator admits; `/metrics` is for admin credentials only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvsplice.storage.pressure import NamespacePressure

PressureFn = Callable[[], Mapping[str, NamespacePressure]]


class NamespacePressureCollector(Collector):
    """`kvsplice_namespace_evictions_total{namespace,reason}` and
    `kvsplice_namespace_refused_puts_total{namespace,reason}`."""

    def __init__(self, pressure: PressureFn) -> None:
        self._pressure = pressure

    def collect(self) -> Iterator[CounterMetricFamily]:
        evictions = CounterMetricFamily(
            "kvsplice_namespace_evictions",
            "Segments removed from a namespace by reason (capacity, quota, ttl, lost).",
            labels=("namespace", "reason"),
        )
        refusals = CounterMetricFamily(
            "kvsplice_namespace_refused_puts",
            "Puts refused for lack of room, by reason (quota, capacity).",
            labels=("namespace", "reason"),
        )
        for namespace, pressure in sorted(self._pressure().items()):
            for reason, n in sorted(pressure.removals.items()):
                evictions.add_metric((namespace, reason), n)
            for reason, n in sorted(pressure.refusals.items()):
                refusals.add_metric((namespace, reason), n)
        yield evictions
        yield refusals

    def describe(self) -> Iterator[CounterMetricFamily]:
        return iter(())
