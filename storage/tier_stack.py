"""Tiers stacked fastest first, the last one durable: write-through, read-promote, delete-all.

Owns the order of tier operations only; what a key means, which keys to evict
and who is told about removals belong to `tiered_store`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvsplice.common.errors import ResourceExhausted
from kvsplice.storage.record import SealedRecord
from kvsplice.storage.tier import StorageTier

logger = logging.getLogger(__name__)

Body = bytes | memoryview
Value = Body | SealedRecord  # what a put hands a tier


class TierStack:
    """`tiers[-1]` is the durable tier (the truth); the tiers above it are caches."""

    def __init__(self, tiers: Sequence[StorageTier]) -> None:
        if not tiers:
            raise ValueError("a tier stack needs at least one tier")
        names = [tier.name for tier in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names {names} are not unique")
        self.tiers = tuple(tiers)
        self.durable = self.tiers[-1]
        self.caches = self.tiers[:-1]

    def fill_caches(self, key: bytes, body: Value, num_levels: int | None = None) -> None:
        """Write `body` into the first `num_levels` caches (all by default).

        A cache that cannot fit it drops its copy instead: an older version
        must never outlive a newer one in a faster tier.
        """
        for cache in self.caches[:num_levels]:
            try:
                cache.put(key, body)
            except ResourceExhausted as exc:
                logger.debug("%s does not cache %s: %s", cache.name, key.hex(), exc)
                cache.delete(key)

    def get(
        self,
        key: bytes,
        is_current: Callable[[Body], bool],
        as_value: Callable[[Body], Value] = lambda body: body,
    ) -> Body | None:
        """The body from the fastest tier holding it, promoted into the tiers above
        as `as_value(body)` (a caller that knows how can hand them a sealed record: the
        body was verified on its way out, so sealing it need not hash it again).

        A cached body that `is_current` rejects (a stale version) is dropped.
        """
        for level, tier in enumerate(self.tiers):
            body = tier.get(key)
            if body is None:
                continue
            if tier is not self.durable and not is_current(body):
                logger.info("%s held a stale version of %s; dropped", tier.name, key.hex())
                tier.delete(key)
                continue
            if level:
                self.fill_caches(key, as_value(body), num_levels=level)
            return body
        return None

    def peek(self, key: bytes) -> Body | None:
        """The body from the fastest tier holding it, promoting nothing (a background read)."""
        for tier in self.tiers:
            body = tier.get(key)
            if body is not None:
                return body
        return None

    def drop_cached(self, key: bytes) -> None:
        for cache in self.caches:
            cache.delete(key)

    def delete(self, key: bytes) -> bool:
        """Remove `key` from every tier, caches first; True if the durable tier held it."""
        self.drop_cached(key)
        return self.durable.delete(key)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
