"""`make_*` factories of valid segment metadata with real chained keys."""

from __future__ import annotations

from collections.abc import Sequence

from kvsplice.common.keys import content_key, context_key, root_key
from kvsplice.common.segment import SegmentMeta

FINGERPRINT = "kvfp1-" + "0" * 32
OTHER_FINGERPRINT = "kvfp1-" + "1" * 32
NAMESPACE = "tenant-a"


def make_meta(
    token_ids: Sequence[int],
    *,
    parent_key: bytes | None = None,
    namespace: str = NAMESPACE,
    fingerprint: str = FINGERPRINT,
    start_position: int = 0,
    left_tail_ids: Sequence[int] = (),
    index_text: str = "",
    key_tokens: Sequence[int] | None = None,
    content_tokens: Sequence[int] | None = None,
    layer_end: int = 30,
) -> SegmentMeta:
    """A segment after `parent_key` (the root key by default). `key_tokens` and
    `content_tokens` forge its context / content key from other tokens (hashes that lie)."""
    parent = root_key(fingerprint) if parent_key is None else parent_key
    tokens = tuple(token_ids)
    return SegmentMeta(
        namespace=namespace,
        model_fingerprint=fingerprint,
        context_key=context_key(parent, tokens if key_tokens is None else key_tokens),
        parent_key=parent,
        content_key=content_key(tokens if content_tokens is None else content_tokens),
        token_ids=tokens,
        start_position=start_position,
        layer_start=0,
        layer_end=layer_end,
        left_tail_ids=tuple(left_tail_ids),
        index_text=index_text,
    )


def make_chain(
    spans: Sequence[Sequence[int]],
    *,
    parent_key: bytes | None = None,
    start_position: int = 0,
    namespace: str = NAMESPACE,
    fingerprint: str = FINGERPRINT,
) -> list[SegmentMeta]:
    """Consecutive segments, each after the previous one, with real left tails."""
    chain: list[SegmentMeta] = []
    left: list[int] = []
    parent, position = parent_key, start_position
    for span in spans:
        meta = make_meta(
            span,
            parent_key=parent,
            namespace=namespace,
            fingerprint=fingerprint,
            start_position=position,
            left_tail_ids=left[-64:],
        )
        chain.append(meta)
        left.extend(span)
        parent, position = meta.context_key, meta.end_position
    return chain


def flatten(chain: Sequence[SegmentMeta]) -> list[int]:
    return [t for meta in chain for t in meta.token_ids]
