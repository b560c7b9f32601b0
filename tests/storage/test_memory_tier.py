"""Memory tier: eviction orders (against brute-force models), budget, oversize values."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.common.errors import ResourceExhausted
from kvsplice.storage.config import MemoryTierConfig
from kvsplice.storage.eviction import LFUOrder, LRUOrder
from kvsplice.storage.memory_tier import MemoryTier
from kvsplice.storage.record import HEADER_NBYTES

VALUE_NBYTES = 1000
RECORD_NBYTES = HEADER_NBYTES + VALUE_NBYTES


def make_tier(num_records: int, policy: str) -> tuple[MemoryTier, list[bytes]]:
    evicted: list[bytes] = []
    config = MemoryTierConfig(max_bytes=num_records * RECORD_NBYTES, policy=policy)
    return MemoryTier(config, on_evict=evicted.append), evicted


def fill(tier: MemoryTier, *keys: bytes) -> None:
    for key in keys:
        tier.put(key, b"x" * VALUE_NBYTES)


def test_lru_evicts_the_least_recently_used() -> None:
    tier, evicted = make_tier(3, "lru")
    fill(tier, b"a", b"b", b"c")
    tier.get(b"a")
    fill(tier, b"d")
    assert evicted == [b"b"]
    fill(tier, b"e")
    assert evicted == [b"b", b"c"]
    assert set(tier.keys()) == {b"a", b"d", b"e"}
    assert tier.stats().evictions == 2


def test_lfu_evicts_the_least_frequently_used_then_the_oldest() -> None:
    tier, evicted = make_tier(3, "lfu")
    fill(tier, b"a", b"b", b"c")
    for key in (b"a", b"a", b"c"):
        tier.get(key)
    fill(tier, b"d")  # b: 1 access, the fewest
    fill(tier, b"e")  # d: 1 access, c: 2, a: 3
    assert evicted == [b"b", b"d"]
    assert set(tier.keys()) == {b"a", b"c", b"e"}


def test_overwrite_is_not_an_eviction() -> None:
    tier, evicted = make_tier(2, "lru")
    fill(tier, b"a", b"b", b"a", b"b")
    assert evicted == []
    assert tier.used_bytes() == 2 * RECORD_NBYTES


def test_oversize_value_is_refused_and_evicts_nothing() -> None:
    tier, evicted = make_tier(2, "lru")
    fill(tier, b"a")
    with pytest.raises(ResourceExhausted):
        tier.put(b"huge", b"x" * (2 * RECORD_NBYTES))
    assert evicted == [] and tier.contains(b"a")


def test_a_value_filling_the_whole_budget_evicts_everything_else() -> None:
    tier, evicted = make_tier(3, "lfu")
    fill(tier, b"a", b"b")
    tier.put(b"all", b"x" * (3 * RECORD_NBYTES - HEADER_NBYTES))
    assert sorted(evicted) == [b"a", b"b"]
    assert tier.used_bytes() == 3 * RECORD_NBYTES


ops = st.lists(
    st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 7), st.integers(0, 2500)),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(["lru", "lfu"]), operations=ops)
def test_budget_is_never_exceeded_and_usage_is_exact(policy: str, operations) -> None:
    tier_evictions: list[bytes] = []
    tier = MemoryTier(
        MemoryTierConfig(max_bytes=6000, policy=policy), on_evict=tier_evictions.append
    )
    expected: dict[bytes, int] = {}
    for op, index, nbytes in operations:
        key = bytes([index])
        if op == "put" and HEADER_NBYTES + nbytes <= 6000:
            tier.put(key, b"v" * nbytes)
            expected[key] = HEADER_NBYTES + nbytes
        elif op == "get":
            tier.get(key)
        elif op == "delete":
            tier.delete(key)
            expected.pop(key, None)
        for gone in tier_evictions:
            expected.pop(gone, None)
        tier_evictions.clear()
        assert tier.used_bytes() <= 6000
        assert tier.used_bytes() == sum(expected.values())
        assert set(tier.keys()) == set(expected)


class OrderModel:
    """Brute force: the victim is the min of (accesses, last access time) — or of time alone."""

    def __init__(self, by_frequency: bool) -> None:
        self.by_frequency = by_frequency
        self.clock = 0
        self.state: dict[bytes, tuple[int, int]] = {}

    def add(self, key: bytes) -> None:
        self.clock += 1
        self.state[key] = (1, self.clock)

    def touch(self, key: bytes) -> None:
        self.clock += 1
        self.state[key] = (self.state[key][0] + 1, self.clock)

    def discard(self, key: bytes) -> None:
        self.state.pop(key, None)

    def victim(self) -> bytes | None:
        if not self.state:
            return None
        rank = (lambda k: self.state[k]) if self.by_frequency else (lambda k: self.state[k][1])
        return min(self.state, key=rank)


def check_lfu_structure(order: LFUOrder) -> None:
    """Nodes: non-empty, strictly increasing counts, consistent links and key->node map."""
    node, prev, seen = order._head, None, 0
    while node is not None:
        assert node.keys, "empty frequency node left linked"
        assert node.prev is prev
        assert prev is None or prev.count < node.count
        for key in node.keys:
            assert order._node_of[key] is node
        seen += len(node.keys)
        prev, node = node, node.next
    assert seen == len(order._node_of)


@settings(max_examples=100, deadline=None)
@given(
    policy=st.sampled_from(["lru", "lfu"]),
    operations=st.lists(
        st.tuples(st.sampled_from(["add", "touch", "discard", "evict"]), st.integers(0, 5))
    ),
)
def test_orders_match_brute_force_models(policy: str, operations) -> None:
    order = LRUOrder() if policy == "lru" else LFUOrder()
    model = OrderModel(by_frequency=policy == "lfu")
    for op, index in operations:
        key = bytes([index])
        tracked = key in model.state
        if op == "add" and not tracked:
            order.add(key)
            model.add(key)
        elif op == "touch" and tracked:
            order.touch(key)
            model.touch(key)
        elif op == "discard":
            order.discard(key)
            model.discard(key)
        elif op == "evict":
            victim = model.victim()
            assert order.victim() == victim
            if victim is not None:
                order.discard(victim)
                model.discard(victim)
        if isinstance(order, LFUOrder):
            check_lfu_structure(order)
    assert order.victim() == model.victim()


def test_lfu_touch_moves_a_key_to_the_neighbouring_node_only() -> None:
    order = LFUOrder()
    for key in (b"a", b"b", b"c"):
        order.add(key)
    order.touch(b"a")
    order.touch(b"a")
    order.touch(b"b")
    counts = []
    node = order._head
    while node is not None:
        counts.append((node.count, list(node.keys)))
        node = node.next
    assert counts == [(1, [b"c"]), (2, [b"b"]), (3, [b"a"])]
    assert order.count_of(b"a") == 3
