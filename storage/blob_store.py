"""Blobs: named byte strings per namespace (anchor payloads, anchor-pool state).

A key space of their own beside segments, with an optional TTL checked on read;
no quota, no catalog. Capacity eviction and locking are lent by `TieredStore`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator

from kvsplice.common.errors import CorruptPayload, InvalidRequest
from kvsplice.storage.keyspace import blob_key, blob_name, blob_prefix
from kvsplice.storage.segment_codec import decode_blob, encode_blob
from kvsplice.storage.tier_stack import TierStack

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
    ) -> None:
        self._stack = stack
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

    def get(self, namespace: str, name: str) -> bytes | None:
        """The blob's bytes; None if absent, expired (then deleted) or undecodable."""
        key = blob_key(namespace, name)
        with self._lock_for(key):
            body = self._stack.get(key, is_current=lambda _: True)
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
            return self._stack.delete(key)

    def iter_names(self, namespace: str, prefix: str = "") -> Iterator[str]:
        """Names starting with `prefix` (expired blobs are listed until read)."""
        keys = self._stack.durable.keys(blob_prefix(namespace, prefix))
        return (blob_name(key, namespace) for key in keys)
