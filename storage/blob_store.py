"""Blobs: named byte strings per namespace (anchor payloads, anchor-pool state).

A key space of their own beside segments, with an optional TTL checked on read;
no quota, no catalog. Capacity eviction and locking are lent by `TieredStore`; with a
shared tier, writes are published and local misses read through it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from kvsplice.common.errors import (
    CorruptPayload,
    InvalidRequest,
    ResourceExhausted,
    StoreUnavailable,
)
from kvsplice.storage.keyspace import blob_key, blob_name, blob_prefix
from kvsplice.storage.segment_codec import decode_blob, encode_blob
from kvsplice.storage.shared_tier import SharedTier
from kvsplice.storage.tier_stack import Body, TierStack

logger = logging.getLogger(__name__)

WriteDurable = Callable[[bytes, bytes], None]


class BlobStore:
    """Blob operations over `stack`; `lock_for(key)` serializes tier work per key."""

    def __init__(
        self,
        stack: TierStack,
        lock_for: Callable[[bytes], threading.RLock],
        write_durable: WriteDurable,
        clock: Callable[[], float],
        shared: SharedTier | None = None,
    ) -> None:
        self._stack = stack
        self._shared = shared
        self._lock_for = lock_for
        self._write_durable = write_durable
        self._clock = clock

    def put(self, namespace: str, name: str, data: bytes, ttl_s: float | None = None) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidRequest(f"ttl_s {ttl_s} must be positive or None")
        key = blob_key(namespace, name)
        body = encode_blob(data, self._clock(), ttl_s)
        with self._lock_for(key):
            self._stack.drop_cached(key)  # first: no cache may keep an older version
            self._write_durable(key, body)
            self._stack.fill_caches(key, body)
        if self._shared is not None:
            self._shared.publish_blob(key)

    def get(self, namespace: str, name: str) -> bytes | None:
        """The blob's bytes; None if absent, expired (then deleted) or undecodable."""
        key = blob_key(namespace, name)
        with self._lock_for(key):
            body = self._stack.get(key, is_current=lambda _: True)
            if body is None:
                body = self._fetch_shared(key)
            if body is None:
                return None
            try:
                header, data = decode_blob(body)
            except CorruptPayload as exc:
                logger.warning("blob %s dropped: %s", key.hex(), exc)
                self._stack.delete(key)
                return None
            if header.expired(self._clock()):
                self._stack.delete(key)
                return None
            return bytes(data)

    def delete(self, namespace: str, name: str) -> bool:
        key = blob_key(namespace, name)
        with self._lock_for(key):
            held = self._stack.delete(key)
        if self._shared is not None:
            self._shared.publish_removal(key, "delete")
        return held

    def iter_names(self, namespace: str, prefix: str = "") -> Iterator[str]:
        """Names starting with `prefix` (expired blobs are listed until read)."""
        keys = self._stack.durable.keys(blob_prefix(namespace, prefix))
        return (blob_name(key, namespace) for key in keys)

    def _fetch_shared(self, key: bytes) -> Body | None:
        """The shared tier's copy, cached locally; None if absent or the tier is degraded."""
        if self._shared is None:
            return None
        try:
            body = self._shared.get(key)
        except StoreUnavailable as exc:
            logger.debug("blob %s not fetched from the shared tier: %s", key.hex(), exc)
            return None
        if body is not None:
            try:
                self._write_durable(key, bytes(body))
                self._stack.fill_caches(key, body)
            except ResourceExhausted as exc:
                logger.info("blob %s read from the shared tier, not cached: %s", key.hex(), exc)
        return body
