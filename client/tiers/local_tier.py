"""The worker's own first tier: recently used segments, ready to splice on the model's device.

Owns `LocalTier`, a byte-bounded LRU of segments keyed by context key (`on_device`
says in which form: a GPU's decoded, a CPU's as stored, which its splice decodes in one pass),
with a parent → children index so an exact lookup can walk the key chain here
before asking the sidecar. It holds what this worker fetched (then confirmed by
the sidecar's index) and what it computed and is still putting (pending). It
decides nothing about reuse, and it is never the authority: an entry the sidecar
no longer lists (expired, deleted, evicted) is dropped by the caller
(`policies.exact`), and an entry past its own TTL is dropped here.
NOTE: what this worker computed is held as computed; with quantized payloads
(int8) a local hit is closer to dense than the sidecar's copy of the same segment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from cachetools import LRUCache

from kvsplice.common.segment import SegmentMeta
from kvsplice.kvmath.payload import KVSource, StoredKV
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

# Keys `take_hit_keys` remembers between two takes (a caller that never takes them).
MAX_TRACKED_HITS = 4096


@dataclass(frozen=True)
class LocalSegment:
    """A segment's K/V and its meta. `pending`: this worker's put is still in flight;
    `acked_at_s`: `time.monotonic()` when that put was acked (0: fetched, or never put).
    """

    meta: SegmentMeta
    kv: KVSource
    pending: bool = False
    acked_at_s: float = 0.0

    def unlisted_is_stale(self, listed_at_s: float) -> bool:
        """Whether a sidecar listing taken at `listed_at_s` that lacks this segment proves
        the sidecar lost it (a put acked after the listing began may simply be newer).
        """
        return not self.pending and self.acked_at_s < listed_at_s

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes

    def expired(self, now_s: float) -> bool:
        ttl_s = self.meta.ttl_s
        return ttl_s is not None and now_s >= self.meta.created_at_s + ttl_s


def on_device(kv: KVSource, device: torch.device) -> KVSource:
    """`kv` as the tier holds it for a model on `device` (itself when it is so already).

    On the CPU, stored K/V stay stored (int8 is 4x smaller, and the splice's fused decode
    writes it at about a memory copy's speed); elsewhere they are decoded once, in fp32,
    and moved there, so a hit costs no transfer and no decode.
    """
    if isinstance(kv, StoredKV):
        if device.type == "cpu":
            return kv
        kv = kv.decode(torch.float32)
    if kv.keys.device == device:
        return kv
    states = {layer: s.to(device) for layer, s in kv.boundary_states.items()}
    return SegmentKV(
        kv.keys.to(device), kv.values.to(device), kv.start_position, kv.layer_start, states
    )


class _Entries(LRUCache):
    """cachetools' LRU, telling the tier which entries it pushed out to stay in budget."""

    def __init__(self, max_bytes: int, on_evict) -> None:
        super().__init__(maxsize=max_bytes, getsizeof=lambda entry: entry.nbytes)
        self._on_evict = on_evict

    def popitem(self):
        key, entry = super().popitem()
        self._on_evict(key, entry)
        return key, entry


class LocalTier:
    """Decoded segments up to `max_bytes` (0 keeps nothing). Thread-safe.

    An entry larger than the whole budget is not kept.
    """

    def __init__(self, max_bytes: int, device: torch.device | str = "cpu") -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes {max_bytes} must be >= 0")
        self.max_bytes = max_bytes
        self.device = torch.device(device)
        self._lock = threading.Lock()
        self._entries = _Entries(max(max_bytes, 1), self._evicted)
        self._children: dict[bytes, set[bytes]] = {}
        self.num_hits = 0
        self._hit_keys: set[bytes] = set()
        self.num_evictions = 0
        self.num_invalidations = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return int(self._entries.currsize)

    def put(self, meta: SegmentMeta, kv: KVSource, *, pending: bool = False) -> None:
        """Keep `kv` under `meta.context_key` (replacing an older entry of that key)."""
        if self.max_bytes == 0 or kv.nbytes > self.max_bytes:
            return
        # NOTE: stored K/V are kept as a copy: they may view the sidecar's LMDB map in
        # place, which pins its read transaction (and its pages) for as long as it is held.
        entry = LocalSegment(meta, kv.copy() if isinstance(kv, StoredKV) else kv, pending)
        with self._lock:
            self._drop(meta.context_key)
            self._entries[meta.context_key] = entry
            self._children.setdefault(meta.parent_key, set()).add(meta.context_key)

    def get(self, context_key: bytes) -> LocalSegment | None:
        """The entry of `context_key`, if held and not past its TTL (an LRU touch)."""
        with self._lock:
            entry = self._entries.get(context_key)
            if entry is not None and entry.expired(time.time()):
                self._drop(context_key)
                return None
            if entry is not None:
                self.num_hits += 1
                if len(self._hit_keys) < MAX_TRACKED_HITS:
                    self._hit_keys.add(context_key)
            return entry

    def take_hit_keys(self) -> frozenset[bytes]:
        """The keys `get` found since the last take (what a call reused from this tier)."""
        with self._lock:
            keys, self._hit_keys = frozenset(self._hit_keys), set()
            return keys

    def child(self, parent_key: bytes, token_ids: Sequence[int], position: int) -> bytes | None:
        """The key of the longest held segment after `parent_key` that starts at `position`
        and whose tokens are the next tokens of `token_ids`.
        """
        with self._lock:
            best: tuple[int, bytes] | None = None
            for key in self._children.get(parent_key, ()):
                meta = self._entries[key].meta
                n = meta.num_tokens
                matches = meta.start_position == position and (
                    tuple(token_ids[position : position + n]) == meta.token_ids
                )
                if matches and (best is None or n > best[0]):
                    best = (n, key)
            return None if best is None else best[1]

    def confirm(self, context_key: bytes) -> None:
        """This worker's put of `context_key` was acked: the sidecar is its authority now."""
        with self._lock:
            entry = self._entries.get(context_key)
            if entry is not None and entry.pending:
                self._entries[context_key] = LocalSegment(
                    entry.meta, entry.kv, False, time.monotonic()
                )

    def invalidate(self, context_key: bytes) -> None:
        """Drop `context_key`: the sidecar does not hold it (any more), or its put failed."""
        with self._lock:
            if self._drop(context_key):
                self.num_invalidations += 1

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._children.clear()

    def _drop(self, context_key: bytes) -> bool:
        entry = self._entries.pop(context_key, None)
        if entry is None:
            return False
        self._forget_child(context_key, entry)
        return True

    def _evicted(self, context_key: bytes, entry: LocalSegment) -> None:
        """The LRU pushed `entry` out to stay within the byte budget (under the lock)."""
        self.num_evictions += 1
        self._forget_child(context_key, entry)

    def _forget_child(self, context_key: bytes, entry: LocalSegment) -> None:
        siblings = self._children.get(entry.meta.parent_key)
        if siblings is not None:
            siblings.discard(context_key)
            if not siblings:
                del self._children[entry.meta.parent_key]
