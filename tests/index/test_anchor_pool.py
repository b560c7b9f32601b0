"""Anchor pools: KVCOMM's least-used-of-oldest eviction without its off-by-one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.index.anchor_pool import AnchorEntry, AnchorPool, AnchorPoolConfig, AnchorPools

FINGERPRINT = "kvfp1-" + "0" * 32


def make_entry(anchor_id: str, seq: int = 0, activation_count: int = 0) -> AnchorEntry:
    return AnchorEntry(anchor_id, num_tokens=16, created_seq=seq, activation_count=activation_count)


def make_pool(counts: dict[str, int], **config) -> AnchorPool:
    """A pool holding `counts`' ids in order, with those activation counts."""
    pool = AnchorPool(AnchorPoolConfig(**config))
    for seq, (anchor_id, count) in enumerate(counts.items()):
        assert pool.add(make_entry(anchor_id, seq)) == []
        pool.touch([anchor_id] * count)
    return pool


def ids(pool: AnchorPool) -> list[str]:
    return [entry.anchor_id for entry in pool.entries()]


def test_full_pool_evicts_least_used_of_the_oldest_window() -> None:
    pool = make_pool({"a": 2, "b": 0, "c": 1, "d": 0}, capacity=4, window=3)
    # "d" is also unused, but it is outside the 3 oldest.
    assert pool.add(make_entry("e", 4)) == ["b"]
    assert ids(pool) == ["a", "c", "d", "e"]


def test_ties_evict_the_oldest() -> None:
    pool = make_pool({"a": 1, "b": 1, "c": 1}, capacity=3, window=3)
    assert pool.add(make_entry("d")) == ["a"]


def test_kvcomm_defaults_hold_exactly_capacity_entries() -> None:
    pool = AnchorPool()  # V=20, W=5
    evicted = [anchor_id for i in range(21) for anchor_id in pool.add(make_entry(f"m{i}", i))]
    assert len(pool) == 20  # KVCOMM's strict '>' would hold 21 here
    assert evicted == ["m0"]


def test_window_larger_than_pool_considers_every_entry() -> None:
    pool = make_pool({"a": 3, "b": 2, "c": 1}, capacity=3, window=10)
    assert pool.add(make_entry("d")) == ["c"]


def test_capacity_one_replaces_the_single_entry() -> None:
    pool = make_pool({"a": 5}, capacity=1, window=5)
    assert pool.add(make_entry("b")) == ["a"]
    assert ids(pool) == ["b"]


def test_readding_an_id_replaces_it_in_place() -> None:
    pool = make_pool({"a": 1, "b": 1}, capacity=2)
    assert pool.add(make_entry("a", seq=9, activation_count=7)) == []
    assert ids(pool) == ["a", "b"]
    assert pool.get("a") == make_entry("a", seq=9, activation_count=7)


def test_touch_counts_and_skips_unknown_ids() -> None:
    pool = make_pool({"a": 0, "b": 0})
    pool.touch(["a", "gone", "a", "b"])
    assert [e.activation_count for e in pool.entries()] == [2, 1]


def test_remove_and_victim() -> None:
    pool = make_pool({"a": 1, "b": 0})
    assert pool.victim() == "b"
    assert pool.remove("b")
    assert not pool.remove("b")
    assert pool.victim() == "a"
    assert pool.remove("a")
    assert pool.victim() is None


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("least_used_of_oldest", "b"), ("least_used", "d"), ("oldest", "a")],
)
def test_policies_pick_their_victim(policy: str, expected: str) -> None:
    pool = make_pool({"a": 2, "b": 1, "c": 2, "d": 0}, capacity=4, window=2, policy=policy)
    assert pool.add(make_entry("e")) == [expected]


@given(
    capacity=st.integers(1, 6),
    window=st.integers(1, 8),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=60),
)
def test_pool_never_exceeds_capacity_and_accounts_for_every_id(
    capacity: int, window: int, ops: list[tuple[bool, int]]
) -> None:
    pool = AnchorPool(AnchorPoolConfig(capacity=capacity, window=window))
    added, evicted = set(), []
    for seq, (is_add, n) in enumerate(ops):
        if is_add:
            anchor_id = f"x{seq}"
            added.add(anchor_id)
            evicted += pool.add(make_entry(anchor_id, seq))
        else:
            pool.touch([f"x{n}"])
        assert len(pool) <= capacity
    assert set(ids(pool)) | set(evicted) == added
    assert len(evicted) == len(set(evicted)) == max(0, len(added) - capacity)


def test_pools_are_keyed_by_namespace_fingerprint_and_placeholder() -> None:
    pools = AnchorPools(AnchorPoolConfig(capacity=2))
    a = pools.get_or_create("tenant-a", FINGERPRINT, "user_question")
    assert pools.get_or_create("tenant-a", FINGERPRINT, "user_question") is a
    assert pools.get_or_create("tenant-b", FINGERPRINT, "user_question") is not a
    assert pools.get("tenant-a", FINGERPRINT, "agent_1_current") is None
    assert a.config.capacity == 2
    assert len(pools) == 2
    assert pools.remove_pool("tenant-b", FINGERPRINT, "user_question")
    with pytest.raises(ValueError, match="namespace"):
        pools.get_or_create("bad namespace!", FINGERPRINT, "p")


def test_pools_round_trip_through_bytes() -> None:
    pools = AnchorPools(AnchorPoolConfig(capacity=3))
    pool = pools.get_or_create("tenant-a", FINGERPRINT, "user_question")
    pool.add(AnchorEntry("q1", 12, created_seq=1, agent_ids=("planner", "critic")))
    pool.add(AnchorEntry("q2", 30, created_seq=2))
    pool.touch(["q2", "q2"])
    pools.get_or_create("tenant-a", FINGERPRINT, "agent_1_current").add(make_entry("r1"))
    restored = AnchorPools.from_bytes(pools.to_bytes(), AnchorPoolConfig(capacity=3))
    assert restored.pool_keys() == pools.pool_keys()
    for key in pools.pool_keys():
        assert restored.get(*key).entries() == pools.get(*key).entries()


def test_loading_under_a_smaller_capacity_trims_by_the_eviction_rule() -> None:
    pools = AnchorPools(AnchorPoolConfig(capacity=3))
    pool = pools.get_or_create("tenant-a", FINGERPRINT, "p")
    for seq, anchor_id in enumerate(["a", "b", "c"]):
        pool.add(make_entry(anchor_id, seq))
    pool.touch(["a"])
    restored = AnchorPools.from_bytes(pools.to_bytes(), AnchorPoolConfig(capacity=2, window=2))
    assert ids(restored.get("tenant-a", FINGERPRINT, "p")) == ["a", "c"]


@pytest.mark.parametrize(
    "data",
    [b'{"version": 99, "pools": []}', b"[]", b'{"version": 1, "pools": [{"namespace": "a"}]}'],
)
def test_loading_a_foreign_document_raises(data: bytes) -> None:
    with pytest.raises(ValueError, match="anchor pools"):
        AnchorPools.from_bytes(data)


@pytest.mark.parametrize(("field", "value"), [("capacity", 0), ("window", 0), ("policy", "random")])
def test_config_rejects_bad_values(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        AnchorPoolConfig(**{field: value})
