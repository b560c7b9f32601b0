"""SimilarityIndex: LSH retrieval of near-duplicates, verification flags, removal."""

from __future__ import annotations

import pytest
from helpers.index import FINGERPRINT, NAMESPACE, OTHER_FINGERPRINT, make_meta
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.common.keys import root_key
from kvsplice.index.similarity_index import (
    SimilarityConfig,
    SimilarityIndex,
    SimilarMatch,
    common_suffix_len,
)

TOOL_OUTPUT = (
    "Tool search_orders returned at {ts}: order {order} for customer {customer} was shipped "
    "from the north warehouse by ground freight; the parcel weighs {kg} kg and the tracking "
    "page reports it in transit towards the regional sorting center, expected delivery "
    "within three business days unless the carrier reports a delay at the border crossing."
)
UNRELATED = (
    "The quick brown fox jumps over the lazy dog while a small orchestra rehearses a "
    "symphony in the old concert hall and the audience waits patiently outside in the rain "
    "for the doors to open before the evening performance finally begins."
)


def tool_output(ts: str, order: int, customer: str, kg: float) -> str:
    return TOOL_OUTPUT.format(ts=ts, order=order, customer=customer, kg=kg)


def make_tokens(seed: int, length: int = 64) -> list[int]:
    return [(seed * 7919 + 31 * i) % 50_000 for i in range(length)]


def make_index(*metas, config: SimilarityConfig | None = None) -> SimilarityIndex:
    index = SimilarityIndex(config)
    for meta in metas:
        index.add(meta)
    return index


def found_keys(matches: list[SimilarMatch]) -> list[bytes]:
    return [m.meta.context_key for m in matches]


def test_near_duplicate_text_with_other_numbers_and_timestamps_is_retrieved() -> None:
    stored = make_meta(
        make_tokens(1), index_text=tool_output("2024-05-01T10:00:00Z", 12345, "c-991", 2.5)
    )
    index = make_index(stored)
    query_text = tool_output("2025-11-30T23:59:59+01:00", 777, "c-12", 14.25)
    matches = index.find_similar(NAMESPACE, FINGERPRINT, make_tokens(2), text=query_text)
    assert found_keys(matches) == [stored.context_key]
    assert matches[0].estimated_jaccard > 0.9
    assert not matches[0].exact_tokens


def test_unrelated_text_is_not_retrieved() -> None:
    stored = make_meta(make_tokens(1), index_text=tool_output("2024-05-01T10:00:00Z", 1, "x", 1))
    index = make_index(stored)
    assert index.find_similar(NAMESPACE, FINGERPRINT, make_tokens(2), text=UNRELATED) == []


def test_near_duplicate_tokens_without_text_are_retrieved() -> None:
    tokens = make_tokens(3, length=128)
    stored = make_meta(tokens)
    index = make_index(stored, make_meta(make_tokens(4, length=128)))
    edited = list(tokens)
    edited[40] = 49_999
    matches = index.find_similar(NAMESPACE, FINGERPRINT, edited)
    assert found_keys(matches) == [stored.context_key]
    assert not matches[0].exact_tokens


def test_exact_tokens_and_same_left_context_are_verified() -> None:
    head = make_meta(make_tokens(5))
    tokens = make_tokens(6)
    stored = make_meta(
        tokens, parent_key=head.context_key, start_position=64, left_tail_ids=head.token_ids
    )
    index = make_index(stored)
    [match] = index.find_similar(
        NAMESPACE, FINGERPRINT, tokens, left_context_ids=head.token_ids, parent_key=head.context_key
    )
    assert (match.exact_tokens, match.same_left_context, match.exact_window) == (True, True, 64)
    [other_context] = index.find_similar(
        NAMESPACE, FINGERPRINT, tokens, left_context_ids=[1, *head.token_ids[-10:]]
    )
    assert other_context.exact_tokens
    assert not other_context.same_left_context
    assert other_context.exact_window == 10


@pytest.mark.parametrize(
    ("left_context", "expected_window"),
    [
        ((1, 2, 7, 8, 9), 3),
        ((9,), 1),
        ((), 0),
        ((5, 6, 7, 8, 1), 0),
        ((0, 0, 5, 6, 7, 8, 9), 5),  # longer than the stored tail: capped by it
        ((6, 7, 8, 9), 4),  # shorter than the stored tail: capped by the query
    ],
)
def test_exact_window_is_the_common_suffix_of_left_contexts(
    left_context: tuple[int, ...], expected_window: int
) -> None:
    tokens = make_tokens(7)
    stored = make_meta(
        tokens,
        parent_key=root_key(FINGERPRINT)[::-1],  # some other left context
        start_position=500,
        left_tail_ids=(5, 6, 7, 8, 9),
    )
    index = make_index(stored)
    [match] = index.find_similar(NAMESPACE, FINGERPRINT, tokens, left_context_ids=left_context)
    assert match.exact_window == expected_window
    assert not match.same_left_context


@given(
    st.lists(st.integers(0, 3), max_size=12),
    st.lists(st.integers(0, 3), max_size=12),
)
def test_common_suffix_len_matches_a_naive_oracle(a: list[int], b: list[int]) -> None:
    naive = 0
    while naive < min(len(a), len(b)) and a[len(a) - 1 - naive] == b[len(b) - 1 - naive]:
        naive += 1
    assert common_suffix_len(a, b) == naive


def test_exact_matches_rank_first_then_jaccard() -> None:
    text = tool_output("2024-01-01T00:00:00Z", 1, "a", 1)
    tokens = make_tokens(8)
    same_text_other_tokens = make_meta(make_tokens(9), index_text=text)
    exact_far = make_meta(
        tokens, parent_key=root_key(FINGERPRINT)[::-1], start_position=9, left_tail_ids=(1, 2)
    )
    exact_near = make_meta(
        tokens, parent_key=root_key(OTHER_FINGERPRINT), start_position=9, left_tail_ids=(3, 2)
    )
    exact_same = make_meta(tokens)
    index = make_index(same_text_other_tokens, exact_far, exact_near, exact_same)
    matches = index.find_similar(
        NAMESPACE,
        FINGERPRINT,
        tokens,
        text=text,
        left_context_ids=(3, 2),
        parent_key=root_key(FINGERPRINT),
    )
    expected = [exact_same, exact_near, exact_far, same_text_other_tokens]
    assert found_keys(matches) == [m.context_key for m in expected]
    assert [m.exact_tokens for m in matches] == [True, True, True, False]
    assert index.find_similar(NAMESPACE, FINGERPRINT, tokens, text=text, limit=2)[1].exact_tokens


def test_exact_tokens_are_found_even_when_only_the_stored_segment_has_text() -> None:
    stored = make_meta(make_tokens(10), index_text=tool_output("2024-01-01", 5, "b", 2))
    index = make_index(stored)
    [match] = index.find_similar(NAMESPACE, FINGERPRINT, make_tokens(10))
    assert match.exact_tokens
    assert match.estimated_jaccard == 1.0


def test_content_key_hit_with_other_tokens_is_not_returned() -> None:
    query = make_tokens(15)
    forged = make_meta(make_tokens(16), content_tokens=query)
    index = make_index(forged)
    assert index.find_similar(NAMESPACE, FINGERPRINT, query) == []


def test_namespaces_and_fingerprints_are_isolated() -> None:
    tokens = make_tokens(11)
    index = make_index(
        make_meta(tokens, namespace="tenant-b"), make_meta(tokens, fingerprint=OTHER_FINGERPRINT)
    )
    assert index.find_similar(NAMESPACE, FINGERPRINT, tokens) == []
    assert len(index.find_similar("tenant-b", FINGERPRINT, tokens)) == 1
    assert len(index.find_similar(NAMESPACE, OTHER_FINGERPRINT, tokens)) == 1


def test_remove_forgets_the_segment() -> None:
    kept = make_meta(make_tokens(12), index_text=tool_output("2024-01-01", 1, "k", 1))
    gone = make_meta(make_tokens(12), parent_key=kept.context_key, index_text=kept.index_text)
    index = make_index(kept, gone)
    assert index.remove(NAMESPACE, gone.context_key)
    assert not index.remove(NAMESPACE, gone.context_key)
    assert len(index) == 1
    matches = index.find_similar(NAMESPACE, FINGERPRINT, make_tokens(12), text=kept.index_text)
    assert found_keys(matches) == [kept.context_key]
    assert index.remove(NAMESPACE, kept.context_key)
    assert index.find_similar(NAMESPACE, FINGERPRINT, make_tokens(12), text=kept.index_text) == []
    index.add(gone)
    assert len(index.find_similar(NAMESPACE, FINGERPRINT, make_tokens(12))) == 1


def test_add_replaces_the_same_key() -> None:
    meta = make_meta(make_tokens(13))
    index = make_index(meta, meta, make_meta(make_tokens(13), layer_end=8))
    assert len(index) == 1
    [match] = index.find_similar(NAMESPACE, FINGERPRINT, make_tokens(13))
    assert match.meta.layer_end == 8


def test_persisted_signature_is_reused_and_a_stale_one_is_replaced() -> None:
    meta = make_meta(make_tokens(14), index_text=tool_output("2024-01-01", 1, "s", 1))
    source = SimilarityIndex()
    other_params = SimilarityIndex(SimilarityConfig(num_perm=64)).signature(meta)
    for signature in (source.signature(meta), other_params, b"garbage"):
        index = SimilarityIndex()
        index.add(meta, signature=signature)
        matches = index.find_similar(NAMESPACE, FINGERPRINT, [1], text=meta.index_text)
        assert found_keys(matches) == [meta.context_key]
        assert matches[0].estimated_jaccard == 1.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_perm", 8),
        ("threshold", 1.0),
        ("min_jaccard", 1.5),
        ("max_candidates", 0),
        ("text_shingle_words", 0),
        ("token_shingle_tokens", 0),
    ],
)
def test_config_rejects_bad_values(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SimilarityConfig(**{field: value})


def test_a_segment_that_begins_as_the_query_is_found_though_the_rest_differs() -> None:
    """The same system prompt, then other text: too little overlap for the LSH, found by
    the head; one that shares all but its first token is not (nor another namespace's)."""
    persona = make_tokens(11, length=40)
    stored = make_meta([*persona, *make_tokens(12, length=88)])
    shifted = make_meta([49_000, *persona[1:], *make_tokens(13, length=88)])
    index = make_index(stored, shifted)
    query = [*persona, *make_tokens(14, length=88)]
    matches = index.find_similar(NAMESPACE, FINGERPRINT, query)
    assert found_keys(matches) == [stored.context_key]
    assert 0 < matches[0].estimated_jaccard < 0.6 and not matches[0].exact_tokens
    assert index.find_similar("other-tenant", FINGERPRINT, query) == []
    assert index.remove(NAMESPACE, stored.context_key)
    assert index.find_similar(NAMESPACE, FINGERPRINT, query) == []
    assert index.find_similar(NAMESPACE, FINGERPRINT, query[:15]) == []  # shorter than a head


def test_lsh_bands_are_picked_once_and_as_datasketch_picks_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A put that made a namespace's first segment paid ~0.2 s of band picking on the event
    # loop, again after its last segment was removed.
    from datasketch import MinHashLSH, lsh

    from kvsplice.index import similarity_index

    similarity_index._lsh_bands.cache_clear()
    picks = []
    real_pick = lsh._optimal_param
    monkeypatch.setattr(lsh, "_optimal_param", lambda *a: picks.append(a) or real_pick(*a))
    meta = make_meta(make_tokens(12))
    index = make_index(meta)
    assert index.remove(NAMESPACE, meta.context_key)
    index.add(meta)
    index.add(make_meta(make_tokens(12), namespace="tenant-b"))
    assert len(picks) == 1
    config = index.config
    expected = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm)
    assert {(g.lsh.b, g.lsh.r) for g in index._groups.values()} == {(expected.b, expected.r)}
    assert len(index.find_similar(NAMESPACE, FINGERPRINT, make_tokens(12))) == 1
