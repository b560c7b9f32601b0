"""Keeps this sidecar's catalog and indexes in step with the other sidecars' writes.

Polls the shared tier's event streams off the event loop and applies what it reads
on the loop (the indexes are loop-only). Owns the polling cadence and catch-up at
start only; what an event does to the store is `TieredStore.apply_shared`'s.

Consistency: per namespace, events apply in stream order; another sidecar's put is
visible here (LookupPrefix, FindSimilar, GetSegment) one poll after its writer
published it (~`POLL_IDLE_S` while the shared tier is up), never before its record is
in the shared tier. While the tier is degraded nothing arrives; polling resumes from
the same stream positions when it returns.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvsplice.server.admin_models import SharedTierOut
from kvsplice.storage.shared_tier import SharedStatus
from kvsplice.storage.tiered_store import TieredStore

logger = logging.getLogger(__name__)

POLL_IDLE_S = 0.05
CATCH_UP_S = 10.0


async def catch_up(store: TieredStore, budget_s: float = CATCH_UP_S) -> int:
    """Apply the retained history of every namespace's stream (at most `budget_s`);
    returns how many events were applied. A degraded tier ends it at once."""
    shared = store.shared
    if shared is None:
        return 0
    deadline = time.monotonic() + budget_s
    num_applied = 0
    while time.monotonic() < deadline:
        events = await asyncio.to_thread(shared.poll)
        if not events:
            break
        store.apply_shared(events)
        num_applied += len(events)
    logger.info("caught up with the shared tier: %d events applied", num_applied)
    return num_applied


async def follow(store: TieredStore) -> None:
    """Apply other sidecars' events until cancelled."""
    shared = store.shared
    if shared is None:
        return
    while True:
        try:
            events = await asyncio.to_thread(shared.poll)
            if events:
                store.apply_shared(events)
                continue
        except Exception:  # the next poll retries; serving goes on meanwhile
            logger.exception("applying shared-tier events failed")
        await asyncio.sleep(POLL_IDLE_S)


def status_out(status: SharedStatus) -> SharedTierOut:
    """`status` as `/readyz` shows it."""
    return SharedTierOut(
        state="degraded" if status.degraded else "connected",
        cluster=status.cluster,
        since_s=status.since_s,
        last_error=status.last_error,
        num_trips=status.num_trips,
        pending_writes=status.num_pending,
        unshared_writes=status.num_unshared,
    )
