"""What the store reports about itself: each tier's counters and fullness, removals by reason.

Owns `StoreStats` (one snapshot, what the metrics and the dashboard read) and the reasons a
segment stops existing; counting them is `tiered_store`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import reduce

from kvsplice.storage.shared_tier import SharedStatus, SharedTier
from kvsplice.storage.tier import StorageTier, TierStats

# delete: asked for; ttl: expired; quota/capacity: evicted for room;
# lost: the durable tier no longer held it (failed verification, or evicted on its own);
# shared: another sidecar removed it (told by the shared tier's events).
REMOVAL_REASONS = ("delete", "ttl", "quota", "capacity", "lost", "shared")


@dataclass(frozen=True)
class TierUsage:
    """How full one tier is now (`capacity_bytes` None: no fixed bound known)."""

    used_bytes: int
    capacity_bytes: int | None


@dataclass(frozen=True)
class StoreStats:
    tiers: Mapping[str, TierStats]
    total: TierStats
    num_segments: int
    stored_bytes: int  # segment bodies (meta + payload), what quotas count
    removals: Mapping[str, int]  # by REMOVAL_REASONS
    usage: Mapping[str, TierUsage]  # by tier name, fastest first (the shared tier last)
    durable_tier: str  # the last local tier: segments live (and are removed) there
    shared: SharedStatus | None = None  # the shared tier's state, when there is one


@dataclass(frozen=True)
class TierViews:
    """Every tier's counters, their sum and each tier's fullness, by tier name."""

    stats: Mapping[str, TierStats]
    total: TierStats
    usage: Mapping[str, TierUsage]


def tier_views(tiers: Sequence[StorageTier | SharedTier]) -> TierViews:
    """`tiers`' counters and fullness now, in their order (fastest first)."""
    stats = {tier.name: tier.stats() for tier in tiers}
    usage = {tier.name: TierUsage(tier.used_bytes(), tier.capacity_bytes()) for tier in tiers}
    return TierViews(stats, reduce(TierStats.__add__, stats.values(), TierStats()), usage)
