"""The segment record's metadata: what the store keeps beside the payload bytes.

The payload itself (K/V per layer, boundary states) is opaque bytes here; its
format belongs to `kvsplice.kvmath.payload`. Namespaces scope every key.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from kvsplice.common.engine_blocks import check_engine_blocks
from kvsplice.common.keys import KEY_NBYTES, MAX_TOKEN_ID, content_key, context_key, is_fingerprint

# fullmatch, never `$`: `$` also matches before a trailing newline ("ns\n").
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
MAX_SEGMENT_TOKENS = 1 << 20
MAX_LEFT_TAIL = 1024
# What a segment holds: a prompt span, a generated response, a placeholder's base
# (prefilled alone after a short lead), or an answer stored again as its sender's
# K/V for anchor bases (under `keys.sender_base_root`).
SegmentKind = Literal["prompt", "response", "base", "sender-base"]
SEGMENT_KINDS: tuple[str, ...] = get_args(SegmentKind)


def validate_namespace(namespace: str) -> str:
    """Return `namespace` or raise `ValueError` naming it."""
    if not isinstance(namespace, str) or not NAMESPACE_PATTERN.fullmatch(namespace):
        raise ValueError(f"namespace {namespace!r} must match {NAMESPACE_PATTERN.pattern}")
    return namespace


def validate_token_ids(token_ids: tuple[int, ...]) -> None:
    """Raise `ValueError` unless 1..MAX_SEGMENT_TOKENS ids in [0, 2**31)."""
    if not 0 < len(token_ids) <= MAX_SEGMENT_TOKENS:
        raise ValueError(f"segment must hold 1..{MAX_SEGMENT_TOKENS} tokens, got {len(token_ids)}")
    bad = next((t for t in token_ids if not 0 <= t <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise ValueError(f"token id {bad} out of range [0, {MAX_TOKEN_ID}]")


@dataclass(frozen=True)
class SegmentMeta:
    """Everything known about a stored segment except its payload bytes.

    `context_key` names the segment (tokens after exactly one left context);
    `parent_key` names that left context (the root key at position 0).
    `checksum` is xxh3-64 of the payload bytes; `layer_end` is exclusive.
    `left_tail_ids` are up to `MAX_LEFT_TAIL` tokens right before the segment
    (the similarity index measures exact-match windows with them);
    `index_text` is the span's text, used only to build similarity signatures.
    `kind`: what the segment holds (`SegmentKind`); `exact`: its K/V equal dense
    prefill of its whole left context (False: computed on top of approximate
    reuse). `labels` are free-form (key, value) pairs the store keeps and indexes never read.
    `engine_block_hashes`: the block hashes the storing engine computed for these tokens, one
    per block, and `engine_parent_block_hash` the one of the block before (`engine_blocks`).
    """

    namespace: str
    model_fingerprint: str
    context_key: bytes
    parent_key: bytes
    content_key: bytes
    token_ids: tuple[int, ...]
    start_position: int
    layer_start: int
    layer_end: int
    boundary_layers: tuple[int, ...] = ()
    payload_nbytes: int = 0
    checksum: int = 0
    ttl_s: float | None = None
    created_at_s: float = 0.0
    left_tail_ids: tuple[int, ...] = ()
    index_text: str = ""
    labels: tuple[tuple[str, str], ...] = field(default=())
    kind: SegmentKind = "prompt"
    exact: bool = False
    engine_block_hashes: tuple[bytes, ...] = ()
    engine_parent_block_hash: bytes = b""

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)
        if not is_fingerprint(self.model_fingerprint):
            raise ValueError(f"model_fingerprint {self.model_fingerprint!r} is malformed")
        for name in ("context_key", "parent_key", "content_key"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != KEY_NBYTES:
                raise ValueError(f"{name} must be {KEY_NBYTES} bytes")
        validate_token_ids(self.token_ids)
        if self.start_position < 0:
            raise ValueError(f"start_position {self.start_position} < 0")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(
                f"layer range [{self.layer_start}, {self.layer_end}) is empty or negative"
            )
        if any(b < 0 for b in self.boundary_layers):
            raise ValueError(f"boundary_layers {self.boundary_layers} has a negative layer")
        if len(self.left_tail_ids) > MAX_LEFT_TAIL:
            raise ValueError(
                f"left_tail_ids holds {len(self.left_tail_ids)} > {MAX_LEFT_TAIL} tokens"
            )
        if self.payload_nbytes < 0:
            raise ValueError(f"payload_nbytes {self.payload_nbytes} < 0")
        if self.kind not in SEGMENT_KINDS:
            raise ValueError(f"kind {self.kind!r} not in {SEGMENT_KINDS}")
        if not isinstance(self.exact, bool):
            raise ValueError(f"exact {self.exact!r} is not a bool")
        if self.ttl_s is not None and not (self.ttl_s > 0 and math.isfinite(self.ttl_s)):
            raise ValueError(f"ttl_s {self.ttl_s} must be a positive finite number or None")
        check_engine_blocks(
            self.engine_block_hashes, self.engine_parent_block_hash, len(self.token_ids)
        )

    @property
    def segment_id(self) -> str:
        """Hex of the context key: the segment's name inside its namespace."""
        return self.context_key.hex()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end_position(self) -> int:
        """Position right after the segment's last token."""
        return self.start_position + len(self.token_ids)


def chained_meta(
    namespace: str,
    fingerprint: str,
    parent_key: bytes,
    token_ids: Sequence[int],
    start_position: int,
    layer_end: int,
    **fields: Any,
) -> SegmentMeta:
    """The meta of `token_ids` stored after `parent_key` at `start_position`, layers
    [0, `layer_end`): its context key chains off `parent_key`, its content key names the
    tokens; `fields` set the rest (payload size and checksum, left tail, text, kind, ...)."""
    tokens = tuple(token_ids)
    return SegmentMeta(
        namespace=namespace,
        model_fingerprint=fingerprint,
        context_key=context_key(parent_key, tokens),
        parent_key=parent_key,
        content_key=content_key(tokens),
        token_ids=tokens,
        start_position=start_position,
        layer_start=0,
        layer_end=layer_end,
        **fields,
    )
