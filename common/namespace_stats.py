"""A namespace's store counters: the one definition the Stats RPC, the client's `stats()` and
the admin API's /v1/stats take their shapes from.

A counter is a field of `NamespaceStats`; the wire (`proto/stats_wire.py`) and the admin JSON
(`server/admin_models.py`) walk the fields, so a new counter is a field here plus the code
that counts it (the server's `SegmentService`). Nothing here counts or sends anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvsplice.common.reuse_report import SERVED, Served, TokenHits


def _counter(doc: str, json: str | None = None) -> Any:
    """A count (>= 0) documented by `doc`; `json`: its /v1/stats key when not its name."""
    return field(default=0, metadata={"doc": doc, "json": json})


@dataclass(frozen=True)
class NamespaceStats(TokenHits):
    """Usage, lookup outcomes and reported reuse of one namespace.

    The token counts are what workers reported (`StoreClient.report_reuse`), kept with the
    tiers across restarts; the other counters count since the sidecar started. The token
    hit rate is `hit_rate` (`common.reuse_report.token_hit_rate`).
    """

    num_segments: int = _counter("segments stored")
    num_bytes: int = _counter("segment bytes stored (what quotas count)", json="stored_bytes")
    num_hits: int = _counter("lookups and reads that found a segment")
    num_misses: int = _counter("lookups and reads that found none")
    num_evictions: int = _counter("removed without a delete (capacity, quota, ttl, lost)")
    num_refused_puts: int = _counter("puts turned away for lack of room (quota or capacity)")
    num_calls: int = _counter("calls workers reported")
    num_prompt_tokens: int = _counter("their prompt tokens", json="num_requested_tokens")
    num_approximate_hit_tokens: int = _counter(
        "of the reused tokens, those approximate (computed at another position or prefix)"
    )
    # ... of which they reused, by where served: local, in_place, grpc
    hit_tokens: Mapping[Served, int] = field(
        default_factory=dict, metadata={"json": "hit_tokens_by_source"}
    )

    def __post_init__(self) -> None:
        for name, value in counters(self).items():
            if value < 0:
                raise ValueError(f"{name} {value} < 0")
        hit = self.hit_tokens
        if set(hit) - set(SERVED) or any(n < 0 for n in hit.values()):
            raise ValueError(f"hit_tokens {dict(hit)} is not counts by {SERVED}")
        if self.num_hit_tokens > self.num_prompt_tokens:
            raise ValueError(f"{self.num_hit_tokens} hit tokens > {self.num_prompt_tokens}")
        if self.num_approximate_hit_tokens > self.num_hit_tokens:
            raise ValueError(
                f"{self.num_approximate_hit_tokens} approximate tokens > {self.num_hit_tokens}"
            )


COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(NamespaceStats) if "doc" in f.metadata)


def counters(stats: NamespaceStats) -> dict[str, int]:
    """Every counter of `stats` by its field name, in definition order."""
    return {name: getattr(stats, name) for name in COUNTERS}


def json_name(name: str) -> str:
    """The /v1/stats key of field `name` (a contract: most are the field's own name)."""
    return next(f.metadata.get("json") or name for f in fields(NamespaceStats) if f.name == name)
