"""What the tiers count, exported at scrape time: requests, evictions, checksum failures, bytes.

Owns the mapping from a `StoreStats` snapshot to Prometheus families; it counts nothing
itself (tiers and the tiered store do) and knows nothing about RPCs or namespaces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvsplice.storage.store_stats import StoreStats

PREFIX = "kvsplice"
# capacity: byte budget (LRU/LFU); ttl: expired; quota: namespace quota;
# corrupt: a cache tier dropped a record that failed its checksum; lost: gone from the
# durable tier behind the store's back (failed verification, or Valkey's own eviction).
# An explicit delete or flush is not an eviction.
EVICTION_REASONS = ("capacity", "ttl", "quota", "corrupt", "lost")
_DURABLE_REASONS = ("capacity", "ttl", "quota", "lost")
StatsFn = Callable[[], StoreStats]


@dataclass(frozen=True)
class _Families:
    """The families of one scrape, filled from one `StoreStats` snapshot."""

    requests: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            f"{PREFIX}_tier_requests",
            "Reads per storage tier by result.",
            labels=["tier", "result"],
        )
    )
    evictions: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            f"{PREFIX}_evictions",
            "Segments a tier removed without being asked, by reason.",
            labels=["tier", "reason"],
        )
    )
    checksum: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            f"{PREFIX}_checksum_failures",
            "Records that failed verification (each served as a miss, never spliced).",
            labels=["tier"],
        )
    )
    used: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            f"{PREFIX}_tier_used_bytes", "Bytes a tier holds now.", labels=["tier"]
        )
    )
    capacity: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            f"{PREFIX}_tier_capacity_bytes", "A tier's byte budget.", labels=["tier"]
        )
    )
    segments: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(f"{PREFIX}_segments", "Segments stored.")
    )
    stored: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            f"{PREFIX}_stored_bytes", "Segment bytes stored (what quotas count)."
        )
    )
    shared_degraded: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            f"{PREFIX}_shared_tier_degraded",
            "1 while the shared tier (Redis/Valkey) is unreachable and local tiers serve alone.",
        )
    )
    shared_pending: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            f"{PREFIX}_shared_tier_pending_writes",
            "Writes acked locally and not yet published to the shared tier.",
        )
    )
    shared_unshared: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            f"{PREFIX}_shared_tier_unshared_writes",
            "Writes dropped from sharing (pending queue full or failed): local only.",
        )
    )

    def all(self) -> list[Metric]:
        return [getattr(self, f.name) for f in fields(self)]


def eviction_counts(stats: StoreStats) -> dict[tuple[str, str], int]:
    """(tier, reason) -> evictions. The durable tier reports the store's removals (a
    self-evicting memory-only store included); a cache tier its own budget evictions and
    the corrupt records it dropped."""
    counts: dict[tuple[str, str], int] = {}
    for tier, tier_stats in stats.tiers.items():
        if tier == stats.durable_tier:
            for reason in EVICTION_REASONS:
                durable = reason in _DURABLE_REASONS
                counts[tier, reason] = stats.removals.get(reason, 0) if durable else 0
        else:
            for reason in EVICTION_REASONS:
                counts[tier, reason] = 0
            counts[tier, "capacity"] = tier_stats.evictions
            counts[tier, "corrupt"] = tier_stats.checksum_failures
    return counts


class StoreCollector(Collector):
    """Reads `StoreStats` from a bound function at each scrape; nothing when unbound."""

    def __init__(self) -> None:
        self._stats_fn: StatsFn | None = None

    def bind(self, stats_fn: StatsFn | None) -> None:
        self._stats_fn = stats_fn

    def describe(self) -> Iterator[Metric]:
        # Names only, so registering never calls into a store that is not built yet.
        return iter(_Families().all())

    def collect(self) -> Iterator[Metric]:
        if self._stats_fn is None:
            return
        stats = self._stats_fn()
        families = _Families()
        for tier, tier_stats in stats.tiers.items():
            families.requests.add_metric([tier, "hit"], tier_stats.hits)
            families.requests.add_metric([tier, "miss"], tier_stats.misses)
            families.checksum.add_metric([tier], tier_stats.checksum_failures)
        for (tier, reason), count in eviction_counts(stats).items():
            families.evictions.add_metric([tier, reason], count)
        for tier, usage in stats.usage.items():
            families.used.add_metric([tier], usage.used_bytes)
            if usage.capacity_bytes is not None:
                families.capacity.add_metric([tier], usage.capacity_bytes)
        families.segments.add_metric([], stats.num_segments)
        families.stored.add_metric([], stats.stored_bytes)
        metrics = families.all()
        if stats.shared is not None:  # without a shared tier these series do not exist
            families.shared_degraded.add_metric([], int(stats.shared.degraded))
            families.shared_pending.add_metric([], stats.shared.num_pending)
            families.shared_unshared.add_metric([], stats.shared.num_unshared)
        else:
            metrics = [f for f in metrics if not f.name.startswith(f"{PREFIX}_shared_tier_")]
        yield from metrics
