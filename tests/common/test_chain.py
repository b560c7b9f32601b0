"""The shared key chain: chunk keys are the chained context keys, links are checked on ids."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.common.keys import (
    KeyChain,
    chunk_links,
    context_key,
    continues,
    off_chain_key,
    root_key,
)
from kvsplice.common.segment import SegmentMeta

FINGERPRINT = "kvfp1-" + "ab" * 16


@given(st.lists(st.integers(0, 50_000), max_size=300), st.integers(1, 64))
def test_chunk_links_are_the_chained_context_keys_of_full_chunks(
    tokens: list[int], chunk: int
) -> None:
    links = chunk_links(FINGERPRINT, tokens, chunk)
    assert len(links) == len(tokens) // chunk
    parent = root_key(FINGERPRINT)
    for i, link in enumerate(links):
        assert (link.start, link.end) == (i * chunk, (i + 1) * chunk)
        assert link.parent_key == parent
        assert link.key == context_key(parent, tokens[link.start : link.end])
        parent = link.key


def test_following_a_stored_segment_equals_extending_over_its_tokens() -> None:
    tokens = list(range(100, 140))
    extended, followed = KeyChain(FINGERPRINT), KeyChain(FINGERPRINT)
    link = extended.extend(tokens[:16])
    followed.follow(link.key, 16)
    assert (followed.parent, followed.position) == (extended.parent, extended.position)
    assert followed.extend(tokens[16:]).key == extended.extend(tokens[16:]).key


def test_leaving_exact_moves_off_chain_once() -> None:
    chain = KeyChain(FINGERPRINT)
    chain.leave_exact()
    chain.leave_exact()
    assert not chain.exact
    assert chain.parent == off_chain_key(root_key(FINGERPRINT))


def test_chunk_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_links(FINGERPRINT, [1, 2, 3], 0)


def _meta(tokens: tuple[int, ...], parent: bytes, start: int) -> SegmentMeta:
    return SegmentMeta(
        namespace="ns", model_fingerprint=FINGERPRINT, context_key=context_key(parent, tokens),
        parent_key=parent, content_key=b"\0" * 16, token_ids=tokens, start_position=start,
        layer_start=0, layer_end=1,
    )  # fmt: skip


def test_continues_checks_parent_position_and_every_token() -> None:
    parent = root_key(FINGERPRINT)
    meta = _meta((5, 6, 7), parent, 0)
    assert continues(meta, parent, [5, 6, 7], 0)
    assert not continues(meta, parent, [5, 6, 8], 0)
    assert not continues(meta, parent, [5, 6, 7], 3)
    assert not continues(meta, off_chain_key(parent), [5, 6, 7], 0)
