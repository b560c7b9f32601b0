"""The key space: chained keys, off-chain and sender-base parents never meet a chain."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvsplice.common.keys import (
    KEY_NBYTES,
    MAX_TOKEN_ID,
    context_key,
    off_chain_key,
    root_key,
    sender_base_root,
)

FINGERPRINT = "kvfp1-" + "ab" * 16
tokens = st.lists(st.integers(0, MAX_TOKEN_ID), min_size=1, max_size=8)


@given(prefix=tokens, step=tokens)
def test_off_chain_parents_are_no_chain_step(prefix: list[int], step: list[int]) -> None:
    parent = context_key(root_key(FINGERPRINT), prefix)
    off = off_chain_key(parent)
    assert len(off) == KEY_NBYTES
    assert off != context_key(parent, step)  # no token ids reach it (no fake id either)
    assert off != off_chain_key(context_key(parent, step))  # distinct per left context


@given(step=tokens)
def test_the_sender_base_root_is_no_chain_and_no_model_root(step: list[int]) -> None:
    base = sender_base_root(FINGERPRINT)
    assert base not in (root_key(FINGERPRINT), context_key(root_key(FINGERPRINT), step))
    assert base != sender_base_root("kvfp1-" + "cd" * 16)
