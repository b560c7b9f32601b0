"""Reads the local tiers miss, served from the shared tier (Redis/Valkey) and cached locally.

Owns the failover read-through (issue 25): fetching a cataloged segment's shared copy,
reading a key the catalog never learned of, and keeping what verifies in the local tiers.
`TieredStore` holds the key's stripe around every call and tells listeners what went or came.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum
from typing import Final, Literal

from kvsplice.common.errors import CorruptPayload, ResourceExhausted, StoreUnavailable
from kvsplice.storage.catalog import CatalogEntry
from kvsplice.storage.room_maker import RoomMaker
from kvsplice.storage.segment_codec import meta_digest
from kvsplice.storage.shared_catalog import Removed, SharedCatalog, verified_entry
from kvsplice.storage.shared_tier import SharedTier
from kvsplice.storage.tier_stack import Body, TierStack

logger = logging.getLogger(__name__)


class Unreachable(Enum):
    """The shared tier could not answer (degraded, or its copy failed verification)."""

    TOKEN = 0


UNREACHABLE: Final = Unreachable.TOKEN
Fetched = Body | Literal[Unreachable.TOKEN] | None


class SharedReads:
    """Reads from `shared` for a store whose local tiers are `stack` (room made by `room`)."""

    def __init__(
        self,
        shared: SharedTier,
        shared_catalog: SharedCatalog,
        stack: TierStack,
        room: RoomMaker,
        expired: Callable[[CatalogEntry], bool],
    ) -> None:
        self._shared = shared
        self._shared_catalog = shared_catalog
        self._stack = stack
        self._room = room
        self._expired = expired

    def fetch(self, key: bytes, entry: CatalogEntry, removed: Removed) -> Fetched:
        """The shared tier's copy of a locally missing segment, cached in the local tiers;
        None if the shared tier lacks it, `UNREACHABLE` while it is degraded (or its copy
        fails verification)."""
        body = self._get(key)
        if body is None:
            # NOTE: a replica may not hold a record its primary just wrote: with replica
            # reads, absence is a miss for now, never proof of loss.
            return UNREACHABLE if self._shared.config.read_from_replicas else None
        if body is UNREACHABLE:
            return UNREACHABLE
        twin = digest_or_none(body) != entry.meta_digest  # another sidecar's put of the key
        if twin and self._shared_catalog.adopt(key, body) is None:
            return UNREACHABLE
        self._cache(key, body, removed)
        return body

    def read_through(self, key: bytes, removed: Removed) -> tuple[CatalogEntry, Body] | None:
        """A key the catalog does not know, read from the shared tier (a put whose event
        this sidecar has not applied, or never will: missed while its catch-up failed,
        or trimmed off the stream); cataloged and cached if it verifies."""
        if self._shared.is_pending(key):
            return None  # removed here, the removal not yet published: never resurrect
        body = self._get(key)
        if body is None or body is UNREACHABLE:
            return None
        entry = verified_entry(key, body)
        if entry is None or self._expired(entry):
            return None
        if not self._shared_catalog.catalog_fetched(key, entry):
            return None  # defensive: events apply under this same stripe
        self._cache(key, body, removed)
        return entry, body

    def _get(self, key: bytes) -> Fetched:
        try:
            return self._shared.get(key)
        except StoreUnavailable as exc:
            logger.debug("segment %s not read from the shared tier: %s", key.hex(), exc)
            return UNREACHABLE

    def _cache(self, key: bytes, body: Body, removed: Removed) -> None:
        """Keep a copy of a shared record in the local tiers, room permitting."""
        try:
            self._room.write_durable(key, bytes(body), removed)
            self._stack.fill_caches(key, body)
        except ResourceExhausted as exc:
            logger.info("segment %s read from the shared tier, not cached: %s", key.hex(), exc)
        else:
            self._shared_catalog.mark_local(key)


def digest_or_none(body: Body) -> int | None:
    """The digest of the record's meta; None if the record is unreadable."""
    try:
        return meta_digest(body)
    except CorruptPayload:
        return None
