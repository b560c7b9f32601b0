"""`StoreAdminSource`: the running store seen through the admin API's `AdminSource` protocol.

Owns the admin-only operations that span services (flushing a namespace clears segments,
anchor blobs and the anchor pools' cache); reads go straight to the segment service.
"""

from __future__ import annotations

import logging

from kvsplice.common.errors import InvalidRequest
from kvsplice.common.keys import KEY_NBYTES
from kvsplice.common.namespace_stats import NamespaceStats
from kvsplice.server.admin_models import (
    FlushResult,
    SegmentHits,
    SegmentSummary,
    TierOverview,
)
from kvsplice.server.anchor_service import AnchorService
from kvsplice.server.request_checks import check_namespace
from kvsplice.server.segment_service import SegmentService
from kvsplice.server.store_collector import EVICTION_REASONS, eviction_counts
from kvsplice.storage.tiered_store import TieredStore

logger = logging.getLogger(__name__)

FLUSH_PAGE = 1000


def segment_key_of(segment_id: str) -> bytes:
    """The context key a hex segment id names; InvalidRequest if it is not one."""
    try:
        key = bytes.fromhex(segment_id)
    except ValueError:
        key = b""
    if len(key) != KEY_NBYTES:
        raise InvalidRequest(f"segment id {segment_id!r} is not {KEY_NBYTES} bytes of hex")
    return key


class StoreAdminSource:
    """Stats, listing, delete and flush over the live services (see `AdminSource`)."""

    def __init__(
        self, store: TieredStore, segments: SegmentService, anchors: AnchorService
    ) -> None:
        self._store = store
        self._segments = segments
        self._anchors = anchors

    def is_ready(self) -> bool:
        return self._segments.is_ready()

    def namespace_stats(self, namespace: str | None) -> dict[str, NamespaceStats]:
        if namespace is not None and namespace not in self._segments.known_namespaces():
            return {}  # `AdminSource`: an unknown namespace has no row (gRPC Stats: zeros)
        return self._segments.namespace_stats(namespace)

    def list_segments(self, namespace: str, offset: int, limit: int) -> list[SegmentSummary]:
        return self._segments.list_segments(namespace, offset, limit)

    def delete_segment(self, namespace: str, segment_id: str) -> bool:
        return self._segments.delete(namespace, segment_key_of(segment_id))

    def flush_namespace(self, namespace: str) -> FlushResult:
        check_namespace(namespace)
        num_segments = freed_bytes = 0
        while page := self._store.list_segments(namespace, 0, FLUSH_PAGE):
            deleted = [m for m in page if self._segments.delete(namespace, m.context_key)]
            num_segments += len(deleted)
            freed_bytes += sum(m.payload_nbytes for m in deleted)
            if not deleted:  # listed but not deletable: never spin
                break
        names = list(self._store.iter_blob_names(namespace))
        num_blobs = sum(self._store.delete_blob(namespace, name) for name in names)
        self._anchors.forget_namespace(namespace)
        logger.info(
            "flushed namespace %s: %d segments (%d bytes), %d blobs",
            namespace, num_segments, freed_bytes, num_blobs,
        )  # fmt: skip
        return FlushResult(namespace, num_segments, freed_bytes, num_blobs)

    def tier_overview(self) -> list[TierOverview]:
        stats = self._store.stats()
        evictions = eviction_counts(stats)
        # NOTE: same-host workers read the durable tier's LMDB map in place (`data_plane`).
        in_place = self._segments.reported_reads("in_place")
        return [
            TierOverview(
                tier=tier,
                used_bytes=stats.usage[tier].used_bytes,
                capacity_bytes=stats.usage[tier].capacity_bytes,
                num_hits=tier_stats.hits,
                num_misses=tier_stats.misses,
                num_checksum_failures=tier_stats.checksum_failures,
                evictions={reason: evictions[tier, reason] for reason in EVICTION_REASONS},
                num_in_place_reads=in_place if tier == stats.durable_tier else None,
            )
            for tier, tier_stats in stats.tiers.items()
        ]

    def top_segments(self, limit: int) -> list[SegmentHits]:
        return self._segments.top_segments(limit)
