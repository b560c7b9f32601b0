"""What capacity pressure did to each namespace: segments removed and puts refused, by reason.

Counts only; `TieredStore` decides when something is counted and holds its own lock
around every call (this class takes none).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

# Removals that are no capacity pressure: asked for, or another sidecar's (counted there).
NOT_PRESSURE = frozenset({"delete", "shared"})


@dataclass(frozen=True)
class NamespacePressure:
    """One namespace: removals by reason (the store's removal reasons but "delete" and
    "shared") and puts refused by reason ("quota": its quota; "capacity": the durable
    tier full with nothing evictable)."""

    removals: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)


class PressureCounters:
    """Per-namespace removal and refusal counters since the store opened."""

    def __init__(self) -> None:
        self._removals: Counter[tuple[str, str]] = Counter()
        self._refusals: Counter[tuple[str, str]] = Counter()

    def removed(self, namespaces_and_reasons: Iterable[tuple[str, str]]) -> None:
        self._removals.update(
            (namespace, reason)
            for namespace, reason in namespaces_and_reasons
            if reason not in NOT_PRESSURE
        )

    def refused(self, namespace: str, reason: str) -> None:
        self._refusals[namespace, reason] += 1

    def snapshot(self) -> dict[str, NamespacePressure]:
        pressure: dict[str, NamespacePressure] = {}
        for (namespace, reason), n in self._removals.items():
            pressure.setdefault(namespace, NamespacePressure()).removals[reason] = n
        for (namespace, reason), n in self._refusals.items():
            pressure.setdefault(namespace, NamespacePressure()).refusals[reason] = n
        return pressure
