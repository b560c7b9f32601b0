"""Belady's offline optimum on a recorded access sequence: the ceiling of any eviction policy.

At a capacity of `capacity` chunks (the trace's chunks are all one size, so this is exact),
on a miss the chunk used furthest in the future goes, the missed one included (bypass):
no policy of that capacity hits more chunks. Pure; knows nothing of the store.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BeladyHits:
    num_hits: int  # chunk accesses served from the cache
    num_prefix_hits: int  # of those, the ones before the request's first miss (what loads)
    num_accesses: int


def belady(requests: Sequence[Sequence[Hashable]], capacity: int) -> BeladyHits:
    """`requests`: each request's chunks in prompt order, requests in time order."""
    flat = [key for request in requests for key in request]
    next_use = _next_uses(flat)
    cached: dict[Hashable, float] = {}  # key -> its next use
    furthest: list[tuple[float, int, Hashable]] = []  # max-heap by next use; stale skipped
    num_hits = num_prefix_hits = 0
    position = 0
    for request in requests:
        intact = True
        for key in request:
            upcoming = next_use[position]
            if key in cached:
                num_hits += 1
                num_prefix_hits += intact
                cached[key] = upcoming
                heapq.heappush(furthest, (-upcoming, position, key))
            else:
                intact = False
                _admit(cached, furthest, key, upcoming, position, capacity)
            position += 1
    return BeladyHits(num_hits, num_prefix_hits, len(flat))


def _admit(
    cached: dict[Hashable, float],
    furthest: list[tuple[float, int, Hashable]],
    key: Hashable,
    upcoming: float,
    position: int,
    capacity: int,
) -> None:
    if upcoming == math.inf or capacity <= 0:
        return  # never used again: not worth a slot
    if len(cached) >= capacity:
        while True:
            negative_use, _, victim = furthest[0]
            if cached.get(victim) == -negative_use:
                break
            heapq.heappop(furthest)  # stale: re-used (or evicted) since
        if -negative_use <= upcoming:
            return  # every cached chunk is used sooner: bypass
        heapq.heappop(furthest)
        del cached[victim]
    cached[key] = upcoming
    heapq.heappush(furthest, (-upcoming, position, key))


def _next_uses(flat: Sequence[Hashable]) -> list[float]:
    upcoming: list[float] = [math.inf] * len(flat)
    last_seen: dict[Hashable, int] = {}
    for position in range(len(flat) - 1, -1, -1):
        key = flat[position]
        upcoming[position] = last_seen.get(key, math.inf)
        last_seen[key] = position
    return upcoming
