"""Eviction orders for the memory tier: LRU and LFU, every operation O(1).

An order only ranks keys; it never holds values or counts bytes (the tier does).

NOTE: not cachetools' LRUCache/LFUCache. Those own the values and evict inside
`__setitem__`, while the memory tier must hand every evicted key to `on_evict` (the
store uncatalogs it) after releasing its lock, refuse an oversize record before
evicting anything, and read a record's prefix without counting an access. Our LFU also
breaks ties by least recent access, which the brute-force model test pins down; what
is left here is a ranking of keys, not a cache.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class EvictionOrder(Protocol):
    def add(self, key: bytes) -> None:
        """Start tracking a key that is not tracked yet."""
        ...

    def touch(self, key: bytes) -> None:
        """Record one access of a tracked key."""
        ...

    def discard(self, key: bytes) -> None:
        """Stop tracking `key` (no-op if untracked)."""
        ...

    def victim(self) -> bytes | None:
        """The key to evict next, or None when nothing is tracked."""
        ...


class LRUOrder:
    """Least recently used first: an OrderedDict whose front is the oldest access."""

    def __init__(self) -> None:
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        self._keys[key] = None

    def touch(self, key: bytes) -> None:
        self._keys.move_to_end(key)

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)

    def victim(self) -> bytes | None:
        return next(iter(self._keys), None)


class _FrequencyNode:
    """All keys accessed exactly `count` times, oldest access first."""

    __slots__ = ("count", "keys", "next", "prev")

    def __init__(self, count: int) -> None:
        self.count = count
        self.keys: OrderedDict[bytes, None] = OrderedDict()
        self.prev: _FrequencyNode | None = None
        self.next: _FrequencyNode | None = None


class LFUOrder:
    """Least frequently used first, ties broken by least recent access.

    NOTE: nodes form a doubly-linked list sorted by count, so the minimum is the
    head and a key moves only to its node's neighbour: O(1) without a heap.
    """

    def __init__(self) -> None:
        self._head: _FrequencyNode | None = None
        self._node_of: dict[bytes, _FrequencyNode] = {}

    def add(self, key: bytes) -> None:
        head = self._head
        node = head if head is not None and head.count == 1 else self._link_after(None, 1)
        node.keys[key] = None
        self._node_of[key] = node

    def touch(self, key: bytes) -> None:
        node = self._node_of[key]
        following = node.next
        if following is None or following.count != node.count + 1:
            following = self._link_after(node, node.count + 1)
        following.keys[key] = None
        self._node_of[key] = following
        self._remove_from(node, key)

    def discard(self, key: bytes) -> None:
        node = self._node_of.pop(key, None)
        if node is not None:
            self._remove_from(node, key)

    def victim(self) -> bytes | None:
        return None if self._head is None else next(iter(self._head.keys))

    def count_of(self, key: bytes) -> int:
        """How many accesses (including the insertion) `key` has had."""
        return self._node_of[key].count

    def _link_after(self, node: _FrequencyNode | None, count: int) -> _FrequencyNode:
        new = _FrequencyNode(count)
        following = self._head if node is None else node.next
        new.prev, new.next = node, following
        if following is not None:
            following.prev = new
        if node is None:
            self._head = new
        else:
            node.next = new
        return new

    def _remove_from(self, node: _FrequencyNode, key: bytes) -> None:
        del node.keys[key]
        if node.keys:
            return
        if node.prev is None:
            self._head = node.next
        else:
            node.prev.next = node.next
        if node.next is not None:
            node.next.prev = node.prev


def make_order(policy: str) -> EvictionOrder:
    """The order for a `MemoryTierConfig.policy` name."""
    if policy == "lru":
        return LRUOrder()
    if policy == "lfu":
        return LFUOrder()
    raise ValueError(f"eviction policy {policy!r} is not 'lru' or 'lfu'")
