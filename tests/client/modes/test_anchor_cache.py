"""The worker's decoded-anchor LRU: byte budget, recency, incarnations, discard."""

from __future__ import annotations

import pytest
import torch
from helpers.modes import make_filled_segment

from kvsplice.client.modes.anchor.pools import AnchorKey, DecodedAnchors, anchor_nbytes
from kvsplice.kvmath.anchors import AgentOffsets, Anchor

FP = "kvfp1-" + "0" * 32


def make_anchor(anchor_id: str, num_tokens: int = 2) -> Anchor:
    base = make_filled_segment([1.0] * num_tokens)
    return Anchor(anchor_id, base, {"a": AgentOffsets(make_filled_segment([0.5] * num_tokens))})


def key(anchor_id: str, seq: int = 1, agent: str = "a", placeholder: str = "q") -> AnchorKey:
    return AnchorKey(FP, placeholder, anchor_id, seq, agent, torch.float32, "cpu")


def test_an_anchor_counts_its_base_and_every_offset() -> None:
    anchor = make_anchor("x")
    segment = anchor.base
    assert anchor_nbytes(anchor) == 2 * (segment.keys.nbytes + segment.values.nbytes)


def test_least_recently_used_anchors_leave_first_within_the_byte_budget() -> None:
    size = anchor_nbytes(make_anchor("x"))
    cache = DecodedAnchors(max_bytes=2 * size)
    cache.put(key("x"), make_anchor("x"))
    cache.put(key("y"), make_anchor("y"))
    assert cache.get(key("x")) is not None  # x is now the most recent
    cache.put(key("z"), make_anchor("z"))
    assert cache.get(key("y")) is None
    assert cache.get(key("x")) is not None and cache.get(key("z")) is not None
    assert cache.nbytes == 2 * size and len(cache) == 2
    assert (cache.hits, cache.misses) == (3, 1)


def test_another_incarnation_or_agent_is_another_entry() -> None:
    cache = DecodedAnchors(max_bytes=1 << 20)
    cache.put(key("x", seq=1), make_anchor("x"))
    assert cache.get(key("x", seq=2)) is None  # evicted and created again in the store
    assert cache.get(key("x", agent="b")) is None
    assert cache.get(key("x", seq=1)) is not None


def test_discard_drops_every_entry_of_one_anchor_only() -> None:
    cache = DecodedAnchors(max_bytes=1 << 20)
    for entry in (key("x", seq=1), key("x", seq=2, agent="b"), key("y"), key("x", placeholder="p")):
        cache.put(entry, make_anchor(entry.anchor_id))
    assert cache.discard(FP, "q", "x") == 2
    assert cache.get(key("y")) is not None and cache.get(key("x", placeholder="p")) is not None
    assert cache.nbytes == 2 * anchor_nbytes(make_anchor("x"))


def test_a_zero_budget_or_an_oversized_anchor_keeps_nothing() -> None:
    for budget in (0, anchor_nbytes(make_anchor("x")) - 1):
        cache = DecodedAnchors(max_bytes=budget)
        cache.put(key("x"), make_anchor("x"))
        assert cache.get(key("x")) is None and cache.nbytes == 0
    with pytest.raises(ValueError, match="max_bytes"):
        DecodedAnchors(max_bytes=-1)
