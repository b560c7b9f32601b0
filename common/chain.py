"""The exact key chain over a token sequence, shared by every engine kvsplice drives.

Which context key names each span stored after exactly its left context, cut in
fixed chunks or at a prompt's own spans, and whether a stored segment really is
the next link of a chain. The HF engine's exact mode and recorder and the vLLM
connector all use it; it knows nothing of tensors, stores or models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.common.keys import context_key, off_chain_key, root_key
from kvsplice.common.segment import SegmentMeta


@dataclass(frozen=True)
class ChainLink:
    """Tokens `[start, end)` stored under `key`, right after the context `parent_key` names."""

    start: int
    end: int
    parent_key: bytes
    key: bytes

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class KeyChain:
    """The key of everything left of a cursor, and whether that left context is exact.

    Starts at the fingerprint's root key (position 0). `extend` hashes the next
    tokens onto the chain; `follow` jumps over a stored segment by its own key.
    Once the left context stops being exact (approximate reuse), the chain moves
    off-chain for good, so no exact lookup can ever reach what follows.
    """

    def __init__(self, model_fingerprint: str) -> None:
        self.parent = root_key(model_fingerprint)
        self.position = 0
        self.exact = True

    def extend(self, token_ids: Sequence[int]) -> ChainLink:
        """Hash `token_ids` (the tokens at the cursor) onto the chain and move past them."""
        link = ChainLink(
            self.position,
            self.position + len(token_ids),
            self.parent,
            context_key(self.parent, token_ids),
        )
        self.parent, self.position = link.key, link.end
        return link

    def follow(self, key: bytes, num_tokens: int) -> None:
        """Move past a stored segment of `num_tokens` named `key` (its parent is ours)."""
        self.parent, self.position = key, self.position + num_tokens

    def leave_exact(self) -> None:
        if self.exact:
            self.parent, self.exact = off_chain_key(self.parent), False


def chunk_links(
    model_fingerprint: str, token_ids: Sequence[int], chunk_tokens: int
) -> list[ChainLink]:
    """The chain over `token_ids` cut every `chunk_tokens` tokens, full chunks only."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens {chunk_tokens} must be >= 1")
    chain = KeyChain(model_fingerprint)
    num_full = len(token_ids) - len(token_ids) % chunk_tokens
    return [
        chain.extend(token_ids[start : start + chunk_tokens])
        for start in range(0, num_full, chunk_tokens)
    ]


def continues(
    meta: SegmentMeta, parent_key: bytes, token_ids: Sequence[int], position: int
) -> bool:
    """`meta` really is the next link after `parent_key`: same parent, tokens and position.

    `token_ids` are the prompt's tokens where the segment would stand; checked on
    the ids, never on a hash alone.
    """
    return (
        meta.parent_key == parent_key
        and meta.start_position == position
        and meta.token_ids == tuple(token_ids)
    )
