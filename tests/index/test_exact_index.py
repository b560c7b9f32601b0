"""ExactIndex: chained runs from position 0, verified on token ids."""

from __future__ import annotations

import itertools

import pytest
from helpers.index import (
    FINGERPRINT,
    NAMESPACE,
    OTHER_FINGERPRINT,
    flatten,
    make_chain,
    make_meta,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.common.keys import root_key
from kvsplice.common.segment import SegmentMeta
from kvsplice.index.exact_index import ExactIndex, ExactIndexConfig, PrefixMatch


def make_index(*metas, config: ExactIndexConfig | None = None) -> ExactIndex:
    index = ExactIndex(config)
    for meta in metas:
        index.add(meta)
    return index


def spans(num_segments: int, width: int = 4) -> list[list[int]]:
    return [[100 * s + t for t in range(width)] for s in range(1, num_segments + 1)]


@pytest.mark.parametrize("num_segments", [1, 2, 3, 4, 5])
def test_chain_matches_whole_run_and_stops_at_unknown_tokens(num_segments: int) -> None:
    chain = make_chain(spans(num_segments))
    index = make_index(*chain)
    match = index.lookup_prefix(NAMESPACE, FINGERPRINT, [*flatten(chain), 7, 8, 9])
    assert match.segments == tuple(chain)
    assert match.num_matched_tokens == 4 * num_segments


def test_prompt_ending_inside_a_segment_matches_only_whole_segments() -> None:
    chain = make_chain(spans(3))
    index = make_index(*chain)
    prompt = flatten(chain)[:10]  # two segments and half of the third
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, prompt) == PrefixMatch(tuple(chain[:2]), 8)


def test_missing_first_segment_is_no_match() -> None:
    chain = make_chain(spans(3))
    index = make_index(*chain[1:])
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, flatten(chain)) == PrefixMatch((), 0)
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, []) == PrefixMatch((), 0)


def test_branching_children_follow_the_prompt() -> None:
    head = make_meta([1, 2, 3])
    left = make_meta([4, 5], parent_key=head.context_key, start_position=3)
    right = make_meta([6, 7], parent_key=head.context_key, start_position=3)
    index = make_index(head, left, right)
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, [1, 2, 3, 6, 7]).segments == (head, right)
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, [1, 2, 3, 4, 5]).segments == (head, left)
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, [1, 2, 3, 9]).segments == (head,)


def test_longest_child_is_preferred_when_both_cover_the_prompt() -> None:
    short, short_next = make_chain([[1, 2], [3, 4, 5, 6]])
    long, long_next = make_chain([[1, 2, 3, 4], [5, 6]])
    index = make_index(short, short_next, long, long_next)
    match = index.lookup_prefix(NAMESPACE, FINGERPRINT, [1, 2, 3, 4, 5, 6])
    assert match == PrefixMatch((long, long_next), 6)


def test_shorter_child_wins_when_it_leads_to_a_longer_run() -> None:
    short, short_next = make_chain([[1, 2], [3, 4, 5, 6]])
    long = make_meta([1, 2, 3, 4])  # a dead end after 4 tokens
    index = make_index(short, short_next, long)
    prompt = [1, 2, 3, 4, 5, 6]
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, prompt) == PrefixMatch(
        (short, short_next), 6
    )
    # With no search budget past the greedy run, the greedy (longest-child) run is kept.
    greedy_only = make_index(short, short_next, long, config=ExactIndexConfig(max_search_nodes=1))
    assert greedy_only.lookup_prefix(NAMESPACE, FINGERPRINT, prompt) == PrefixMatch((long,), 4)


def test_hash_correct_but_token_mismatched_segment_is_never_returned() -> None:
    query = [5, 6, 7, 8]
    # Its context key is exactly the query span's key after the root, but its tokens differ.
    forged = make_meta([5, 6, 7, 9], key_tokens=query)
    index = make_index(forged)
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, query) == PrefixMatch((), 0)


def test_token_matched_segment_whose_key_does_not_chain_is_rejected() -> None:
    query = [5, 6, 7, 8]
    forged = make_meta(query, key_tokens=[1, 1, 1, 1])
    child = make_meta([9], parent_key=forged.context_key, start_position=4)
    index = make_index(forged, child)
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, [*query, 9]) == PrefixMatch((), 0)


def test_namespaces_and_fingerprints_are_isolated() -> None:
    chain = make_chain(spans(2))
    other_ns = make_chain(spans(2), namespace="tenant-b")
    index = make_index(*chain, *other_ns)
    prompt = flatten(chain)
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, prompt).segments == tuple(chain)
    assert index.lookup_prefix("tenant-b", FINGERPRINT, prompt).segments == tuple(other_ns)
    assert index.lookup_prefix("tenant-c", FINGERPRINT, prompt) == PrefixMatch((), 0)
    assert index.lookup_prefix(NAMESPACE, OTHER_FINGERPRINT, prompt) == PrefixMatch((), 0)


def test_segment_labelled_with_another_fingerprint_is_not_returned() -> None:
    # Chained from this fingerprint's root but recorded for another model.
    stray = make_meta([1, 2], fingerprint=OTHER_FINGERPRINT, parent_key=make_meta([0]).parent_key)
    index = make_index(stray)
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, [1, 2]) == PrefixMatch((), 0)


def test_removing_a_middle_segment_truncates_the_run() -> None:
    chain = make_chain(spans(3))
    index = make_index(*chain)
    prompt = flatten(chain)
    assert index.remove(NAMESPACE, chain[1].context_key)
    assert not index.remove(NAMESPACE, chain[1].context_key)
    assert len(index) == 2
    assert index.get(NAMESPACE, chain[1].context_key) is None
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, prompt) == PrefixMatch((chain[0],), 4)
    index.add(chain[1])
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, prompt).segments == tuple(chain)


def test_add_is_idempotent_and_replaces_the_same_key() -> None:
    meta = make_meta([1, 2, 3])
    replacement = make_meta([1, 2, 3], layer_end=12)
    index = make_index(meta, meta)
    assert len(index) == 1
    index.add(replacement)
    assert len(index) == 1
    assert index.get(NAMESPACE, meta.context_key) == replacement
    assert index.lookup_prefix(NAMESPACE, FINGERPRINT, [1, 2, 3]).segments == (replacement,)


def test_deep_chain_is_matched_without_recursion() -> None:
    chain = make_chain([[t] for t in range(1500)])
    index = make_index(*chain)
    match = index.lookup_prefix(NAMESPACE, FINGERPRINT, flatten(chain))
    assert match.num_matched_tokens == 1500
    assert match.segments == tuple(chain)


def test_config_rejects_zero_budget() -> None:
    with pytest.raises(ValueError, match="max_search_nodes 0"):
        ExactIndexConfig(max_search_nodes=0)


def longest_run_oracle(
    metas: list[SegmentMeta], parent: bytes, prompt: list[int], position: int
) -> int:
    """Exhaustive search over every stored segment (no trie, no budget)."""
    best = 0
    for meta in metas:
        end = position + meta.num_tokens
        if meta.parent_key == parent and tuple(prompt[position:end]) == meta.token_ids:
            best = max(
                best, meta.num_tokens + longest_run_oracle(metas, meta.context_key, prompt, end)
            )
    return best


@settings(max_examples=30, deadline=None)
@given(
    prompt=st.lists(st.integers(1, 2), min_size=1, max_size=10),
    cut_lists=st.lists(st.lists(st.integers(1, 9), max_size=4), min_size=1, max_size=4),
    keep=st.lists(st.booleans(), min_size=16, max_size=16),
)
def test_lookup_finds_the_longest_run_of_any_stored_segmentation(
    prompt: list[int], cut_lists: list[list[int]], keep: list[bool]
) -> None:
    metas: list[SegmentMeta] = []
    for cuts in cut_lists:
        bounds = [0, *sorted({c for c in cuts if c < len(prompt)}), len(prompt)]
        chain = make_chain([prompt[a:b] for a, b in itertools.pairwise(bounds)])
        metas += [m for i, m in enumerate(chain) if keep[(len(metas) + i) % len(keep)]]
    index = make_index(*metas)
    match = index.lookup_prefix(NAMESPACE, FINGERPRINT, prompt)
    assert match.num_matched_tokens == longest_run_oracle(metas, root_key(FINGERPRINT), prompt, 0)
    assert flatten(match.segments) == prompt[: match.num_matched_tokens]
    parents = [root_key(FINGERPRINT), *(m.context_key for m in match.segments)]
    assert [m.parent_key for m in match.segments] == parents[: len(match.segments)]
