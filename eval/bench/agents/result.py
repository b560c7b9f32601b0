"""What a `bench agents` run measured (`BenchResult`), and its results.json form.

Both the run (`bench`) and its files (`report`) import it; it knows nothing of either.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvsplice.common.namespace_stats import NamespaceStats
from kvsplice.eval.bench.agents.config import BenchAgentsConfig
from kvsplice.eval.bench.store_session import stats_json
from kvsplice.eval.measure.metrics import Aggregates, CallRecord


@dataclass
class BenchResult:
    """Everything a run measured, and where its files are (`files`: name → path)."""

    config: BenchAgentsConfig
    environment: dict[str, object]
    records: list[CallRecord]
    aggregates: Aggregates
    wall_s: float
    namespaces: dict[str, str]
    # mode → its namespace's `StoreStats` as a dict at the end of the run (None: no answer)
    store_stats: dict[str, NamespaceStats | None] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)

    def capacity_losses(self) -> dict[str, tuple[int, int]]:
        """mode → (evictions, refused puts), for the modes whose namespace lost any.

        A segment evicted before a later sample could hit it, or never admitted,
        makes that mode's reuse (and speedup) lower than the mode itself would give.
        """
        losses = {}
        for mode, stats in self.store_stats.items():
            if stats is None:
                continue
            lost = (stats.num_evictions, stats.num_refused_puts)
            if any(lost):
                losses[mode] = lost
        return losses

    def to_dict(self) -> dict[str, object]:
        config = asdict(self.config)
        config["out_dir"] = str(self.config.out_dir)
        config["data_path"] = _optional_str(self.config.data_path)
        config["policy_path"] = _optional_str(self.config.policy_path)
        admission = self.config.admission
        config["admission"] = None if admission is None else json.loads(admission.to_json())
        config["model"] = {k: str(v) for k, v in asdict(self.config.model).items()}
        return {
            "config": config,
            "environment": self.environment,
            "wall_s": self.wall_s,
            "namespaces": self.namespaces,
            "store_stats": stats_json(self.store_stats),
            "aggregates": self.aggregates.to_dict(),
            "records": [r.to_dict() for r in self.records],
        }


def _optional_str(path: Path | None) -> str | None:
    return None if path is None else str(path)
