"""The store's face of session leases: holds by context key, under the store's lock.

Owns turning a namespace's context keys into the catalog's keys and sizes; what a hold
means and the eviction order it implies belong to `sessions`, the lock to `TieredStore`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from kvsplice.common.segment import SegmentMeta
from kvsplice.storage.catalog import Catalog
from kvsplice.storage.config import StoreConfig
from kvsplice.storage.keyspace import segment_key
from kvsplice.storage.sessions import Hold, SessionLeases


class SessionHolds:
    """`TieredStore.sessions`. With `config.sessions.lease_s` 0 every hold is rejected and the
    catalog's eviction order is left exactly as it is without sessions."""

    def __init__(
        self,
        config: StoreConfig,
        catalog: Catalog,
        lock: threading.Lock,
        clock: Callable[[], float],
    ) -> None:
        sessions = config.sessions
        self._leases = SessionLeases(
            sessions.lease_s, sessions.max_lease_s, config.quota_for, clock, sessions.rules
        )
        self._catalog = catalog
        self._lock = lock
        if self._leases.enabled:
            catalog.retention = self._leases

    @property
    def enabled(self) -> bool:
        return self._leases.enabled

    def hold(
        self,
        namespace: str,
        session_id: str,
        context_keys: Sequence[bytes],
        lease_s: float | None = None,
    ) -> Hold:
        """Renew the session's lease and hold those of `context_keys` the store holds."""
        with self._lock:
            sized = []
            parents = {}
            for context_key in context_keys:
                key = segment_key(namespace, context_key)
                entry = self._catalog.get(key)
                if entry is not None:
                    sized.append((key, entry.body_nbytes))
                    parents[key] = segment_key(namespace, entry.meta.parent_key)
            return self._leases.hold((namespace, session_id), sized, lease_s, parents)

    def end(self, namespace: str, session_id: str) -> bool:
        """Release the session's segments now (evicted first from here on); False if not live."""
        with self._lock:
            return self._leases.end((namespace, session_id))

    def num_live(self) -> int:
        with self._lock:
            self._leases.expire()
            return self._leases.num_live()

    def held_nbytes(self, namespace: str) -> int:
        with self._lock:
            return self._leases.held_nbytes(namespace)

    def forget_locked(self, removed: Iterable[SegmentMeta]) -> None:
        """Segments that left the store (the caller holds the store's lock)."""
        for meta in removed:
            self._leases.forget(segment_key(meta.namespace, meta.context_key))
