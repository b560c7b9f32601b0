"""Anchor pools (KVComm): which anchors a placeholder has, their use counts, eviction.

Bookkeeping only: the anchor bytes live in the store and the offset math in
the client. Unlike KVCOMM's `update_anchor` (which evicts once the pool *exceeds*
`max_anchor_num`, so it holds V+1), a pool here evicts before it would exceed V.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from kvsplice.common.config_flags import flag
from kvsplice.common.segment import validate_namespace

logger = logging.getLogger(__name__)

POOLS_FORMAT_VERSION = 1


@dataclass
class AnchorEntry:
    """One anchor of a placeholder: its stored id, base length, creation order,
    how often the client's weighting used it, and the agents holding offsets for it."""

    anchor_id: str
    num_tokens: int
    created_seq: int
    activation_count: int = 0
    agent_ids: tuple[str, ...] = ()


# A policy picks the victim among the entries (insertion order, oldest first):
# the candidate with the smallest key; `index` breaks ties toward the oldest.
_VictimKey = Callable[[int, AnchorEntry], tuple[int, ...]]


def _least_used_key(index: int, entry: AnchorEntry) -> tuple[int, ...]:
    return (entry.activation_count, index)


def _oldest_key(index: int, entry: AnchorEntry) -> tuple[int, ...]:
    return (index,)


# name -> (victim key, whether only the oldest `window` entries are candidates)
_POLICIES: dict[str, tuple[_VictimKey, bool]] = {
    "least_used_of_oldest": (_least_used_key, True),  # KVCOMM's rule
    "least_used": (_least_used_key, False),
    "oldest": (_oldest_key, False),
}


@dataclass(frozen=True)
class AnchorPoolConfig:
    """`capacity` V: most entries a pool holds; `window` W: with the KVCOMM policy,
    the victim is the least-activated of the W oldest entries (ties: the oldest)."""

    capacity: int = flag(20, "Anchors kept per placeholder.", name="anchor-capacity", min=1)
    window: int = flag(5, "Recent uses an anchor's score counts.", name="anchor-window", min=1)
    policy: str = "least_used_of_oldest"

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"capacity {self.capacity} must be >= 1")
        if self.window < 1:
            raise ValueError(f"window {self.window} must be >= 1")
        if self.policy not in _POLICIES:
            raise ValueError(f"policy {self.policy!r} is not one of {sorted(_POLICIES)}")


class AnchorPool:
    """The anchors of one placeholder, in insertion order (oldest first)."""

    def __init__(self, config: AnchorPoolConfig | None = None) -> None:
        self.config = config or AnchorPoolConfig()
        self._entries: dict[str, AnchorEntry] = {}  # insertion-ordered
        self.last_seq = -1  # the highest creation number handed out (persisted)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[AnchorEntry]:
        return list(self._entries.values())

    def get(self, anchor_id: str) -> AnchorEntry | None:
        return self._entries.get(anchor_id)

    def add(self, entry: AnchorEntry) -> list[str]:
        """Insert `entry` as the newest; return the ids evicted to make room.

        Re-adding a present id replaces that entry in place and evicts nothing.
        """
        if entry.anchor_id in self._entries:
            self._entries[entry.anchor_id] = entry
            return []
        evicted = []
        while len(self._entries) >= self.config.capacity:
            evicted.append(self._evict_one())
        self._entries[entry.anchor_id] = entry
        return evicted

    def touch(self, anchor_ids: Iterable[str]) -> None:
        """Count one activation of each id; ids no longer pooled (evicted meanwhile) are skipped."""
        for anchor_id in anchor_ids:
            entry = self._entries.get(anchor_id)
            if entry is not None:
                entry.activation_count += 1

    def remove(self, anchor_id: str) -> bool:
        return self._entries.pop(anchor_id, None) is not None

    def next_seq(self) -> int:
        """A creation number above every entry's, present or removed since (so an anchor
        pooled again under the same id is told apart from its earlier incarnation)."""
        seqs = [e.created_seq for e in self._entries.values()]
        self.last_seq = max([self.last_seq, *seqs]) + 1
        return self.last_seq

    def victim(self) -> str | None:
        """The id the policy would evict next; `None` when empty."""
        victim_key, windowed = _POLICIES[self.config.policy]
        candidates = list(self._entries.values())
        if windowed:
            candidates = candidates[: self.config.window]
        if not candidates:
            return None
        _, entry = min(enumerate(candidates), key=lambda item: victim_key(*item))
        return entry.anchor_id

    def _evict_one(self) -> str:
        anchor_id = self.victim()
        assert anchor_id is not None, "evicting from an empty pool"
        del self._entries[anchor_id]
        return anchor_id


_PoolKey = tuple[str, str, str]  # namespace, fingerprint, placeholder id


class AnchorPools:
    """All pools, one per (namespace, fingerprint, placeholder_id)."""

    def __init__(self, config: AnchorPoolConfig | None = None) -> None:
        self.config = config or AnchorPoolConfig()
        self._pools: dict[_PoolKey, AnchorPool] = {}

    def __len__(self) -> int:
        return len(self._pools)

    def get(self, namespace: str, fingerprint: str, placeholder_id: str) -> AnchorPool | None:
        return self._pools.get((namespace, fingerprint, placeholder_id))

    def get_or_create(self, namespace: str, fingerprint: str, placeholder_id: str) -> AnchorPool:
        key = (validate_namespace(namespace), fingerprint, placeholder_id)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = AnchorPool(self.config)
        return pool

    def remove_pool(self, namespace: str, fingerprint: str, placeholder_id: str) -> bool:
        return self._pools.pop((namespace, fingerprint, placeholder_id), None) is not None

    def pool_keys(self) -> list[_PoolKey]:
        return list(self._pools)

    def to_bytes(self) -> bytes:
        """Versioned JSON of every pool and entry (config not included)."""
        pools = [
            {
                "namespace": ns,
                "fingerprint": fp,
                "placeholder_id": ph,
                "entries": _entries_json(pool),
                "last_seq": pool.last_seq,
            }
            for (ns, fp, ph), pool in self._pools.items()
        ]
        return json.dumps({"version": POOLS_FORMAT_VERSION, "pools": pools}).encode()

    @classmethod
    def from_bytes(cls, data: bytes, config: AnchorPoolConfig | None = None) -> AnchorPools:
        """Pools from `to_bytes`, under `config`. A pool larger than its new
        capacity is trimmed by the eviction rule (logged): the caller reconciles
        stored anchor bytes against the entries that remain."""
        document = json.loads(data)
        if not isinstance(document, dict) or document.get("version") != POOLS_FORMAT_VERSION:
            raise ValueError(f"anchor pools document is not format version {POOLS_FORMAT_VERSION}")
        pools = cls(config)
        try:
            for item in document["pools"]:
                pool = pools.get_or_create(
                    item["namespace"], item["fingerprint"], item["placeholder_id"]
                )
                pools._load_entries(pool, item["entries"])
                pool.last_seq = int(item.get("last_seq", -1))
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed anchor pools document: {err!r}") from err
        return pools

    @staticmethod
    def _load_entries(pool: AnchorPool, raw_entries: list[dict[str, Any]]) -> None:
        for raw in raw_entries:
            evicted = pool.add(_entry_from_json(raw))
            if evicted:
                logger.warning("anchor pool over capacity on load; evicted %s", evicted)


def _entries_json(pool: AnchorPool) -> list[dict[str, object]]:
    return [{**asdict(entry), "agent_ids": list(entry.agent_ids)} for entry in pool.entries()]


def _entry_from_json(raw: dict[str, Any]) -> AnchorEntry:
    return AnchorEntry(
        anchor_id=str(raw["anchor_id"]),
        num_tokens=int(raw["num_tokens"]),
        created_seq=int(raw["created_seq"]),
        activation_count=int(raw.get("activation_count", 0)),
        agent_ids=tuple(str(agent_id) for agent_id in raw.get("agent_ids", ())),
    )
