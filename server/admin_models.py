"""The admin API's contract: the `AdminSource` protocol, its small result records, JSON shapes.

The server side adapts its store to `AdminSource`; the admin app (`server/admin.py`)
knows nothing else about it. Records are plain frozen dataclasses; the pydantic
models only fix the JSON the endpoints return.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from kvsplice.common.keys import KEY_NBYTES
from kvsplice.common.reuse_report import SERVED, token_hit_rate
from kvsplice.common.segment import SegmentMeta, validate_namespace


@dataclass(frozen=True)
class NamespaceStats:
    """Usage, lookup outcomes and reported reuse of one namespace since the process started.

    The token counts are what workers reported (`StoreClient.report_reuse`): prompt
    tokens of their calls, and those reused, by where they were served
    (`hit_tokens_by_source`: "local", "in_place", "grpc"; empty: not split).
    """

    namespace: str
    num_segments: int
    stored_bytes: int
    num_hits: int  # lookups and reads that found a segment
    num_misses: int
    num_requested_tokens: int = 0  # prompt tokens of the calls workers reported
    num_hit_tokens: int = 0  # ... of which they reused
    num_evictions: int = 0  # removed without a delete (capacity, quota, ttl, lost)
    num_refused_puts: int = 0  # refused for lack of room (quota, full tier)
    num_calls: int = 0  # calls workers reported
    hit_tokens_by_source: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)
        for name in ("num_segments", "stored_bytes", "num_hits", "num_misses",
                     "num_requested_tokens", "num_hit_tokens", "num_evictions",
                     "num_refused_puts", "num_calls"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} {getattr(self, name)} < 0")
        if self.num_hit_tokens > self.num_requested_tokens:
            raise ValueError(f"{self.num_hit_tokens} hit tokens > {self.num_requested_tokens}")
        by_source = self.hit_tokens_by_source
        if set(by_source) - set(SERVED) or any(n < 0 for n in by_source.values()):
            raise ValueError(f"hit_tokens_by_source {dict(by_source)} is not counts by {SERVED}")
        if by_source and sum(by_source.values()) != self.num_hit_tokens:
            raise ValueError(f"hit_tokens_by_source {dict(by_source)} != {self.num_hit_tokens}")

    @property
    def hit_rate(self) -> float | None:
        """The token hit rate in [0, 1]; None before the first report
        (`common.reuse_report.token_hit_rate`, the one definition kvsplice reports)."""
        return token_hit_rate(self.num_hit_tokens, self.num_requested_tokens)


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
        return cls(
            segment_id=meta.segment_id,
            model_fingerprint=meta.model_fingerprint,
            num_tokens=meta.num_tokens,
            start_position=meta.start_position,
            layer_start=meta.layer_start,
            layer_end=meta.layer_end,
            boundary_layers=meta.boundary_layers,
            payload_nbytes=meta.payload_nbytes,
            created_at_s=meta.created_at_s,
            ttl_s=meta.ttl_s,
        )


class AdminSource(Protocol):
    """What the admin API reads from the running store.

    Called on the event loop that also runs the gRPC server, so calls must be
    cheap and bounded (the API pages segment listings); faults raise
    `KvspliceError` subclasses, which the API maps to HTTP status codes.
    """

    def is_ready(self) -> bool:
        """True once tiers are mounted and indexes rebuilt, False while shutting down."""
        ...

    def namespace_stats(self, namespace: str | None) -> list[NamespaceStats]:
        """Stats of `namespace`, or of every namespace when None (empty if unknown)."""
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


class NamespaceStatsOut(BaseModel):
    model_config = ConfigDict(frozen=True)

    namespace: str
    num_segments: int
    stored_bytes: int
    num_hits: int
    num_misses: int
    num_requested_tokens: int
    num_hit_tokens: int
    hit_rate: float | None  # token hit rate: num_hit_tokens / num_requested_tokens
    hit_tokens_by_source: dict[str, int]  # reused tokens by where served: local, in_place, grpc
    num_calls: int  # calls workers reported
    num_evictions: int
    num_refused_puts: int

    @classmethod
    def of(cls, stats: NamespaceStats) -> NamespaceStatsOut:
        return cls(
            namespace=stats.namespace,
            num_segments=stats.num_segments,
            stored_bytes=stats.stored_bytes,
            num_hits=stats.num_hits,
            num_misses=stats.num_misses,
            num_requested_tokens=stats.num_requested_tokens,
            num_hit_tokens=stats.num_hit_tokens,
            hit_rate=stats.hit_rate,
            hit_tokens_by_source={s: stats.hit_tokens_by_source.get(s, 0) for s in SERVED},
            num_calls=stats.num_calls,
            num_evictions=stats.num_evictions,
            num_refused_puts=stats.num_refused_puts,
        )


class StatsOut(BaseModel):
    namespaces: list[NamespaceStatsOut]


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
