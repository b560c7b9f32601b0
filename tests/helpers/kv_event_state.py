"""What a KV-aware router holds after a stream of KV events, whoever's classes decoded them
(vLLM's or `server.kv_event_wire`'s: the same tags, the same fields)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def held_after(events: Iterable[Any]) -> set[int | bytes]:
    """The block hashes held after applying `events` in order."""
    held: set[int | bytes] = set()
    for event in events:
        kind = type(event).__name__
        if kind == "AllBlocksCleared":
            held.clear()
        elif kind == "BlockStored":
            held.update(event.block_hashes)
        elif kind == "BlockRemoved":
            held.difference_update(event.block_hashes)
        else:
            raise ValueError(f"not a KV event: {event!r}")
    return held
