"""Keeps this sidecar's catalog and indexes in step with the other sidecars' writes.

Polls the shared tier's event streams off the event loop and applies what it reads
on the loop (the indexes are loop-only). Owns the polling cadence and the catch-up at
start; what an event does to the store is `TieredStore.apply_shared`'s.

Consistency: per namespace, events apply in stream order; another sidecar's put is
visible here (LookupPrefix, FindSimilar, GetSegment) one poll after its writer
published it (~`POLL_IDLE_S` while the shared tier is up), never before its record is
in the shared tier. While the tier is degraded nothing arrives; polling resumes from
the same stream positions when it returns.

Catch-up: the history is read when one poll reached the end of every stream without a
fault. A fault (a failover under way) is retried, never taken for the end; the sidecar
reports ready once caught up. Only a tier unreachable since start (issue 15), or one
that stays faulty for `timeout_s`, lets it serve from its local tiers first; the
follower then finishes the catch-up and `/readyz` shows `caught_up` until it has.
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
CATCH_UP_TIMEOUT_S = 30.0


async def catch_up(store: TieredStore, timeout_s: float = CATCH_UP_TIMEOUT_S) -> int:
    """Apply the retained history of every namespace's stream, retrying faults for up to
    `timeout_s`; returns how many events were applied."""
    shared = store.shared
    if shared is None:
        return 0
    if not shared.ever_connected:
        logger.warning("shared tier unreachable since start: catching up once it appears")
        return 0
    deadline = time.monotonic() + timeout_s
    num_applied, num_faults = 0, 0
    while True:
        polled = await asyncio.to_thread(shared.poll)
        store.apply_shared(polled.events)
        num_applied += len(polled.events)
        if polled.at_end:
            break
        if polled.events:
            continue  # a full batch: read on
        num_faults += 1
        if time.monotonic() > deadline:
            logger.warning(
                "not caught up with the shared tier after %.0f s (%d events applied, %s): "
                "serving from local tiers, the follower finishes it",
                timeout_s,
                num_applied,
                shared.status().last_error or "faults",
            )
            return num_applied
        await asyncio.sleep(shared.config.probe_interval_s)
    retried = f" ({num_faults} faults retried)" if num_faults else ""
    logger.info("caught up with the shared tier: %d events applied%s", num_applied, retried)
    return num_applied


async def follow(store: TieredStore) -> None:
    """Apply other sidecars' events until cancelled."""
    shared = store.shared
    if shared is None:
        return
    caught_up = shared.status().caught_up
    while True:
        try:
            polled = await asyncio.to_thread(shared.poll)
            store.apply_shared(polled.events)
            if polled.at_end and not caught_up:
                caught_up = True
                logger.info("caught up with the shared tier (late, by the follower)")
            if polled.events:
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
        caught_up=status.caught_up,
    )
