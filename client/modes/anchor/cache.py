"""Decoded anchors kept in the worker between calls: a byte-bounded LRU.

Owns `DecodedAnchors`. The anchor gate needs a placeholder's whole pool on
every call; fetching and dequantizing each anchor again (a base plus one
agent's offsets: megabytes per anchor) is most of the gate's cost. An entry
is keyed by the anchor's `created_seq` as the store lists it, so an anchor
evicted and created again (a new base, new offsets) is a different entry
and the listing itself tells a stale entry apart; only the listing is asked
for on every call.

NOTE: offsets an agent re-puts for an anchor already pooled (the same agent
template seen again in another context) are seen here only once the entry
leaves the cache, or at once when this worker puts them (`discard`). Both are
offsets of that agent against the same stored base, so either corrects.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvsplice.client.modes.anchor.anchors import Anchor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AnchorKey:
    """What makes a decoded anchor reusable: whose offsets, which anchor incarnation, what form."""

    fingerprint: str
    placeholder_id: str
    anchor_id: str
    created_seq: int
    agent_id: str
    dtype: torch.dtype
    device: str


def anchor_nbytes(anchor: Anchor) -> int:
    """Bytes held by an anchor's tensors (base and every agent's offsets)."""
    segments = [anchor.base]
    for offsets in anchor.offsets_by_agent.values():
        segments.append(offsets.placeholder)
        if offsets.prefix is not None:
            segments.append(offsets.prefix)
    return sum(s.keys.nbytes + s.values.nbytes for s in segments)


class DecodedAnchors:
    """Least-recently-used decoded anchors up to `max_bytes` (0 keeps nothing). Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes {max_bytes} must be >= 0")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[AnchorKey, tuple[Anchor, int]] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: AnchorKey) -> Anchor | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found[0]

    def put(self, key: AnchorKey, anchor: Anchor) -> None:
        """Keep `anchor` (an anchor larger than the whole budget is not kept)."""
        size = anchor_nbytes(anchor)
        if size > self.max_bytes:
            return
        with self._lock:
            self._pop(key)
            self._entries[key] = (anchor, size)
            self._nbytes += size
            while self._nbytes > self.max_bytes:
                self._pop(next(iter(self._entries)))

    def discard(self, fingerprint: str, placeholder_id: str, anchor_id: str) -> int:
        """Drop every entry of one anchor (any incarnation, agent or form); how many."""
        with self._lock:
            stale = [
                k
                for k in self._entries
                if (k.fingerprint, k.placeholder_id, k.anchor_id)
                == (fingerprint, placeholder_id, anchor_id)
            ]
            for key in stale:
                self._pop(key)
            return len(stale)

    def _pop(self, key: AnchorKey) -> None:
        found = self._entries.pop(key, None)
        if found is not None:
            self._nbytes -= found[1]
