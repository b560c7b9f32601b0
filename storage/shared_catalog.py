"""The catalog entries other sidecars create: segments known from the shared tier's events.

Owns which cataloged keys this sidecar does not hold locally, and how an event or a
version fetched from the shared tier changes the catalog. `TieredStore` calls it with
the key's stripe held; it takes the store's catalog lock itself, around no I/O.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from kvsplice.common.errors import CorruptPayload
from kvsplice.common.segment import SegmentMeta
from kvsplice.storage.catalog import Catalog, CatalogEntry
from kvsplice.storage.keyspace import BLOB_SPACE, blob_name, segment_key
from kvsplice.storage.segment_codec import meta_digest, meta_span, read_meta, segment_payload
from kvsplice.storage.segment_events import SharedEvent
from kvsplice.storage.tier_stack import Body, TierStack

logger = logging.getLogger(__name__)

Removed = list[tuple[SegmentMeta, str]]


@dataclass
class Applied:
    """What applying events changed, for the listeners (told after the locks are released)."""

    removed: Removed = field(default_factory=list)
    arrived: list[SegmentMeta] = field(default_factory=list)
    blobs: list[tuple[str, str]] = field(default_factory=list)  # (namespace, name)


class SharedCatalog:
    """Remote-only keys of `catalog` (guarded by `lock`) and the rules that change them."""

    def __init__(self, catalog: Catalog, lock: threading.Lock, stack: TierStack) -> None:
        self._catalog = catalog
        self._lock = lock
        self._stack = stack
        self._remote_keys: set[bytes] = set()  # cataloged from events, not held locally

    def is_remote(self, key: bytes) -> bool:
        """True if `key` is cataloged but held only by the shared tier (caller holds lock)."""
        return key in self._remote_keys

    def mark_remote(self, keys: list[bytes]) -> None:
        """`keys` left the local tiers but stay cataloged (caller holds lock)."""
        self._remote_keys.update(keys)

    def mark_local(self, key: bytes) -> None:
        with self._lock:
            self._remote_keys.discard(key)

    def apply_locked(self, event: SharedEvent, applied: Applied) -> None:
        """Apply one event (the caller holds its key's stripe)."""
        if event.op == "blob":
            self._drop_local_copy(event.key)
            applied.blobs.append((event.namespace, blob_name(event.key, event.namespace)))
        elif event.op == "remove":
            self._apply_remove(event, applied)
        else:
            self._apply_put(event, applied)

    def adopt(self, key: bytes, body: Body) -> CatalogEntry | None:
        """Catalog `body`, another version of cataloged `key` (a twin put through another
        sidecar), in place of the current entry; None if it does not verify."""
        entry = verified_entry(key, body)
        if entry is None:
            return None
        with self._lock:
            if self._catalog.get(key) is None:
                return None
            self._catalog.insert(key, entry)
        return entry

    def catalog_fetched(self, key: bytes, entry: CatalogEntry) -> bool:
        """Catalog `entry` (of a body read from the shared tier, see `verified_entry`) for a
        key this catalog did not know, held remotely until cached; False if known now."""
        with self._lock:
            if self._catalog.get(key) is not None:
                return False
            self._catalog.insert(key, entry)
            self._remote_keys.add(key)
        return True

    def _apply_remove(self, event: SharedEvent, applied: Applied) -> None:
        key = event.key
        with self._lock:
            entry = self._catalog.pop(key)
            self._remote_keys.discard(key)
        self._drop_local_copy(key)
        if entry is not None:
            applied.removed.append((entry.meta, "shared"))
        elif key.startswith(BLOB_SPACE):
            applied.blobs.append((event.namespace, blob_name(key, event.namespace)))

    def _apply_put(self, event: SharedEvent, applied: Applied) -> None:
        key = event.key
        try:
            meta = read_meta(event.head)
            if segment_key(meta.namespace, meta.context_key) != key:
                raise CorruptPayload("event names another segment's key")
        except CorruptPayload as exc:
            logger.warning("shared put event of %s ignored: %s", key.hex(), exc)
            return
        nbytes = meta_span(event.head) + meta.payload_nbytes
        entry = CatalogEntry(meta, nbytes, meta_digest(event.head))
        with self._lock:
            # NOTE: a key names its tokens and whole left context (model included), so
            # every version of it holds the same KV: a key already cataloged (our own
            # put, replayed; or a twin put through two sidecars at once) is kept as is.
            if self._catalog.get(key) is not None:
                return
            self._catalog.insert(key, entry)
            self._remote_keys.add(key)
        self._drop_local_copy(key)  # a stale copy of a removed incarnation, if any
        applied.arrived.append(meta)

    def _drop_local_copy(self, key: bytes) -> None:
        # NOTE: looked up first: most events name keys held nowhere here, and a delete
        # is a write transaction (an fsync with a synced LMDB) on the event loop.
        for tier in self._stack.tiers:
            if tier.contains(key):
                tier.delete(key)


def verified_entry(key: bytes, body: Body) -> CatalogEntry | None:
    """The catalog entry of `body` stored under `key`; None unless it is `key`'s segment
    and its payload checksum holds."""
    try:
        meta = read_meta(body)
        if segment_key(meta.namespace, meta.context_key) != key:
            return None
        segment_payload(body, meta)  # verifies the payload checksum
    except CorruptPayload:
        return None
    return CatalogEntry(meta, len(body), meta_digest(body))
