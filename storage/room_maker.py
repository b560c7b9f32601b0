"""Room for a record: namespace quota reservations and the durable tier's capacity evictions.

Owns which unleased segments are claimed (their stripes tried, never waited for) and evicted
to make room, and counts the puts refused for lack of it. `TieredStore` owns the locks it
hands in, decides when a record is stored, and tells listeners about what was `removed`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from kvsplice.common.errors import ResourceExhausted
from kvsplice.storage.catalog import Catalog, CatalogEntry
from kvsplice.storage.config import StoreConfig
from kvsplice.storage.pressure import PressureCounters
from kvsplice.storage.record import SealedRecord
from kvsplice.storage.shared_catalog import Removed, SharedCatalog
from kvsplice.storage.shared_tier import SharedTier
from kvsplice.storage.tier_stack import TierStack


class Victim(NamedTuple):
    key: bytes
    entry: CatalogEntry
    stripe: threading.RLock


class RoomMaker:
    """Makes room in `catalog` (guarded by `lock`) and the durable tier of `stack`.

    Callers hold the stripe of the key they write; `stripe(key)` names any other key's,
    which is only ever *tried* (see `TieredStore`'s NOTE on locking). With a `shared` tier
    the local tiers cache the cluster, so a capacity victim leaves them but stays cataloged.
    """

    def __init__(
        self,
        config: StoreConfig,
        catalog: Catalog,
        lock: threading.Lock,
        stripe: Callable[[bytes], threading.RLock],
        stack: TierStack,
        pressure: PressureCounters,
        shared: tuple[SharedCatalog, SharedTier] | None,
    ) -> None:
        self._config = config
        self._catalog = catalog
        self._lock = lock
        self._stripe = stripe
        self._stack = stack
        self._pressure = pressure  # guarded by `lock`, like the catalog
        self._shared = shared

    def reserve_quota(self, key: bytes, entry: CatalogEntry) -> list[Victim]:
        """Reserve the entry's bytes, claiming the namespace's LRU victims that must go first."""
        namespace, nbytes = entry.meta.namespace, entry.body_nbytes
        quota = self._config.quota_for(namespace)
        with self._lock:
            victims: list[Victim] = []
            if quota is not None:
                old = self._catalog.get(key)
                replaced_nbytes = 0 if old is None else old.body_nbytes
                excess = self._catalog.used_bytes(namespace) - replaced_nbytes + nbytes - quota
                victims = self._claim(namespace, excess, exclude=key) if nbytes <= quota else []
                if nbytes > quota or sum(v.entry.body_nbytes for v in victims) < excess:
                    self._unclaim(victims)
                    self._pressure.refused(namespace, "quota")
                    raise ResourceExhausted(
                        f"namespace {namespace!r}: {nbytes} bytes do not fit its quota of "
                        f"{quota} bytes (segments being read cannot be evicted)"
                    )
                self._pop_claimed(victims)
            self._catalog.reserve(namespace, nbytes)
        return victims

    def write_durable(
        self, key: bytes, body: bytes | SealedRecord, removed: Removed, namespace: str | None = None
    ) -> None:
        """Put into the durable tier, evicting while it is full: fair share first (see
        `Catalog.fair_victims`), so a writer never silently empties another namespace.

        With a shared tier the local tiers cache the cluster: a capacity victim is only
        dropped here (still cataloged, read back from the cluster), not removed.
        """
        durable = self._stack.durable
        capacity = durable.capacity_bytes()
        if capacity is not None and len(body) > capacity:
            if namespace is not None:
                with self._lock:
                    self._pressure.refused(namespace, "capacity")
            raise ResourceExhausted(f"{len(body)} bytes exceed {durable.name}'s {capacity} bytes")
        while True:
            try:
                durable.put(key, body)
                return
            except ResourceExhausted as exc:
                victims = self._claim_capacity(namespace, len(body), key)
                if not victims:
                    raise ResourceExhausted(
                        f"{durable.name} is full and no unleased segment is left to evict"
                    ) from exc
                if self._shared is None:
                    self.evict(victims, "capacity", removed)
                else:
                    self._drop_local(victims)

    def evict(self, victims: list[Victim], reason: str, removed: Removed) -> None:
        """Delete claimed (already uncataloged) victims from every tier."""
        removed.extend((victim.entry.meta, reason) for victim in victims)
        self._drop_local(victims)

    def _claim_capacity(self, namespace: str | None, nbytes: int, key: bytes) -> list[Victim]:
        """Claim fair-share victims worth `nbytes` of the durable tier (uncataloged, or marked
        remote with a shared tier); none claimable counts a refusal for `namespace`."""
        with self._lock:
            # NOTE: room in the durable tier is made only by segments it holds.
            victims = [
                Victim(k, entry, self._stripe(k))
                for k, entry in self._catalog.fair_victims(
                    namespace, nbytes, key, self._try_local_stripe
                )
            ]
            if self._shared is None:
                self._pop_claimed(victims)
            else:
                self._shared[0].mark_remote([victim.key for victim in victims])
            if not victims and namespace is not None:
                self._pressure.refused(namespace, "capacity")
        return victims

    def _drop_local(self, victims: list[Victim]) -> None:
        """Delete claimed victims from the local tiers and release their stripes (a shared
        tier keeps its copies: the store publishes removals, not this)."""
        try:
            for victim in victims:
                self._stack.delete(victim.key)
        finally:
            self._unclaim(victims)

    def _claim(self, namespace: str | None, nbytes: int, exclude: bytes) -> list[Victim]:
        """LRU unleased segments worth >= `nbytes` whose stripes were free (caller holds `lock`)."""
        # NOTE: room in the durable tier is made only by segments it holds; a segment
        # known from the shared tier alone frees nothing there (quotas count both).
        try_claim = self._try_stripe if namespace is not None else self._try_local_stripe
        victims = []
        for key, entry in self._catalog.lru_victims(namespace, nbytes, exclude, try_claim):
            victims.append(Victim(key, entry, self._stripe(key)))
        return victims

    def _try_stripe(self, key: bytes) -> bool:
        return self._stripe(key).acquire(blocking=False)

    def _try_local_stripe(self, key: bytes) -> bool:
        if self._shared is not None:
            shared_catalog, shared = self._shared
            if shared_catalog.is_remote(key) or shared.is_pending(key):
                return False  # frees nothing here, or not shared yet: the only copy
        return self._try_stripe(key)

    def _pop_claimed(self, victims: list[Victim]) -> None:
        for victim in victims:
            self._catalog.pop(victim.key)

    def _unclaim(self, victims: list[Victim]) -> None:
        for victim in victims:
            victim.stripe.release()
