"""The admin API's contract: the `AdminSource` protocol, its small result records, JSON shapes.

The server side adapts its store to `AdminSource`; the admin app (`server/admin.py`)
knows nothing else about it. Records are plain frozen dataclasses; the pydantic
models only fix the JSON the endpoints return.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, create_model

from kvsplice.common.keys import KEY_NBYTES
from kvsplice.common.namespace_stats import COUNTERS, NamespaceStats, counters, json_name
from kvsplice.common.reuse_report import SERVED, token_hit_rate
from kvsplice.common.segment import SegmentMeta


@dataclass(frozen=True)
class SegmentSummary:
    """One stored segment as an operator sees it (no tokens, no payload)."""

    segment_id: str  # hex of the context key
    model_fingerprint: str
    num_tokens: int
    start_position: int
    layer_start: int
    layer_end: int  # exclusive
    boundary_layers: tuple[int, ...]
    payload_nbytes: int
    created_at_s: float
    ttl_s: float | None
    exact: bool = True  # False: off the exact chain (computed over approximate reuse)

    def __post_init__(self) -> None:
        if len(self.segment_id) != 2 * KEY_NBYTES or self.segment_id.strip("0123456789abcdef"):
            raise ValueError(f"segment_id {self.segment_id!r} is not {KEY_NBYTES} bytes of hex")
        if self.num_tokens <= 0 or self.start_position < 0 or self.payload_nbytes < 0:
            raise ValueError(
                f"bad segment summary: num_tokens={self.num_tokens} "
                f"start_position={self.start_position} payload_nbytes={self.payload_nbytes}"
            )

    @classmethod
    def from_meta(cls, meta: SegmentMeta) -> SegmentSummary:
        """The summary of `meta` (each field is the meta's attribute of the same name)."""
        return cls(**{f.name: getattr(meta, f.name) for f in fields(cls)})


class AdminSource(Protocol):
    """What the admin API reads from the running store.

    Called on the event loop that also runs the gRPC server, so calls must be
    cheap and bounded (the API pages segment listings); faults raise
    `KvspliceError` subclasses, which the API maps to HTTP status codes.
    """

    def is_ready(self) -> bool:
        """True once tiers are mounted and indexes rebuilt, False while shutting down."""
        ...

    def namespace_stats(self, namespace: str | None) -> dict[str, NamespaceStats]:
        """Stats of `namespace`, or of every namespace when None (empty if unknown), by
        namespace in sorted order."""
        ...

    def list_segments(self, namespace: str, offset: int, limit: int) -> list[SegmentSummary]:
        """Up to `limit` segments of `namespace` from `offset`, in a stable order."""
        ...

    def delete_segment(self, namespace: str, segment_id: str) -> bool:
        """Delete one segment; False if it was not stored."""
        ...

    def flush_namespace(self, namespace: str) -> FlushResult:
        """Delete every segment and anchor of `namespace`."""
        ...

    def tier_overview(self) -> list[TierOverview]:
        """Each tier's fill, reads, evictions and faults, fastest first (the dashboard)."""
        ...

    def top_segments(self, limit: int) -> list[SegmentHits]:
        """The `limit` stored segments read most often, most first (the dashboard)."""
        ...


@dataclass(frozen=True)
class TierOverview:
    """One tier as the dashboard shows it; counters since the process started."""

    tier: str
    used_bytes: int
    capacity_bytes: int | None
    num_hits: int
    num_misses: int
    num_checksum_failures: int
    evictions: Mapping[str, int]  # by reason (see server.store_collector.EVICTION_REASONS)
    # Reads workers made of its map in place (same host), as they reported them; None: a
    # tier nobody reads in place. The sidecar never sees these reads itself.
    num_in_place_reads: int | None = None


@dataclass(frozen=True)
class SegmentHits:
    namespace: str
    segment_id: str
    num_tokens: int
    payload_nbytes: int
    num_hits: int


@dataclass(frozen=True)
class FlushResult:
    """What `flush_namespace` removed."""

    namespace: str
    num_segments: int
    freed_bytes: int
    num_blobs: int


def _row_fields() -> dict[str, Any]:
    """A /v1/stats row: the namespace, every `NamespaceStats` counter under its JSON name, then
    the reused tokens (in all, by where served, the exact ones) and the token hit rates."""
    return {
        "namespace": (str, ...),
        **{json_name(name): (int, ...) for name in COUNTERS},
        "num_hit_tokens": (int, ...),
        "hit_rate": (float | None, ...),  # num_hit_tokens / num_requested_tokens
        json_name("hit_tokens"): (dict[str, int], ...),  # local, in_place, grpc
        "num_exact_hit_tokens": (int, ...),  # num_hit_tokens - num_approximate_hit_tokens
        "exact_hit_rate": (float | None, ...),  # num_exact_hit_tokens / num_requested_tokens
    }


NamespaceStatsOut = create_model(
    "NamespaceStatsOut", __config__=ConfigDict(frozen=True), **_row_fields()
)
StatsOut = create_model("StatsOut", namespaces=(list[NamespaceStatsOut], ...))  # type: ignore[valid-type]


def stats_row(namespace: str, stats: NamespaceStats) -> dict[str, Any]:
    """The /v1/stats row of `namespace` (the fields of `NamespaceStatsOut`)."""
    return {
        "namespace": namespace,
        **{json_name(name): value for name, value in counters(stats).items()},
        "num_hit_tokens": stats.num_hit_tokens,
        "hit_rate": stats.hit_rate,
        json_name("hit_tokens"): {s: stats.hit_tokens.get(s, 0) for s in SERVED},
        "num_exact_hit_tokens": stats.num_exact_hit_tokens,
        "exact_hit_rate": token_hit_rate(stats.num_exact_hit_tokens, stats.num_prompt_tokens),
    }


class SegmentPageOut(BaseModel):
    namespace: str
    offset: int
    limit: int
    next_offset: int | None  # None when the page came back short: nothing follows
    segments: list[SegmentSummary]


class DeletedOut(BaseModel):
    namespace: str
    segment_id: str
    deleted: bool


class FlushOut(BaseModel):
    namespace: str
    num_segments: int
    freed_bytes: int
    num_blobs: int


class SharedTierOut(BaseModel):
    """The shared tier as `/readyz` shows it; `state` is "connected" or "degraded"."""

    state: str
    cluster: bool
    since_s: float
    last_error: str
    num_trips: int
    pending_writes: int
    unshared_writes: int
    caught_up: bool  # the streams' history was read (a sidecar serving before: False)


class StatusOut(BaseModel):
    status: str
    shared_tier: SharedTierOut | None = None
