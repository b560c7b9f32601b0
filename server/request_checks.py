"""The sidecar's request rules: namespaces, fingerprints, keys, token ranges, TTLs, a put's header.

Each check returns the value it accepts or raises `InvalidRequest` naming it; a put's keys
must be the hashes of the tokens they name. Storing and indexing are `segment_service`'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace

from kvsplice.common.errors import InvalidRequest
from kvsplice.common.keys import (
    KEY_NBYTES,
    MAX_TOKEN_ID,
    content_key,
    context_key,
    is_fingerprint,
    root_key,
)
from kvsplice.common.segment import MAX_LEFT_TAIL, SegmentMeta, validate_namespace
from kvsplice.server.config import SegmentServiceConfig

MAX_POSITION = MAX_TOKEN_ID  # a segment ends at or before this position
MAX_TTL_S = 10 * 365 * 86400.0
MAX_LABEL_CHARS = 256


def check_namespace(namespace: str) -> str:
    try:
        return validate_namespace(namespace)
    except ValueError as error:
        raise InvalidRequest(str(error)) from error


def check_fingerprint(fingerprint: str) -> str:
    if not is_fingerprint(fingerprint):
        raise InvalidRequest(f"model_fingerprint {fingerprint[:64]!r} is not kvfp1-<32 hex>")
    return fingerprint


def check_ttl(ttl_s: float) -> float | None:
    """A wire TTL (0: the server's default) as the meta's `ttl_s`; NaN, inf, < 0 are refused."""
    if not (math.isfinite(ttl_s) and 0 <= ttl_s <= MAX_TTL_S):
        raise InvalidRequest(f"ttl_s {ttl_s!r} must be finite and in [0, {MAX_TTL_S:.0f}]")
    return ttl_s or None


def check_key(name: str, key: bytes) -> bytes:
    if len(key) != KEY_NBYTES:
        raise InvalidRequest(f"{name} must be {KEY_NBYTES} bytes, got {len(key)}")
    return key


def check_token_ids(name: str, token_ids: Sequence[int], max_tokens: int) -> tuple[int, ...]:
    """`token_ids` as a tuple if it holds at most `max_tokens` ids in [0, 2**31)."""
    if len(token_ids) > max_tokens:
        raise InvalidRequest(f"{name} holds {len(token_ids)} tokens > limit {max_tokens}")
    ids = tuple(token_ids)
    if ids and not (min(ids) >= 0 and max(ids) <= MAX_TOKEN_ID):
        bad = next(t for t in ids if not 0 <= t <= MAX_TOKEN_ID)
        raise InvalidRequest(f"{name}: token id {bad} out of range [0, {MAX_TOKEN_ID}]")
    return ids


def check_header(meta: SegmentMeta, limits: SegmentServiceConfig) -> SegmentMeta:
    """Validate a put's header before its payload arrives; returns it as it will be stored."""
    check_token_ids("token_ids", meta.token_ids, limits.max_segment_tokens)
    check_token_ids("left_tail_ids", meta.left_tail_ids, MAX_LEFT_TAIL)
    if meta.end_position > MAX_POSITION:
        raise InvalidRequest(
            f"start_position {meta.start_position} + {meta.num_tokens} tokens > {MAX_POSITION}"
        )
    if meta.ttl_s is not None:
        check_ttl(meta.ttl_s)
    if any(
        not (0 < len(k) <= MAX_LABEL_CHARS and len(v) <= MAX_LABEL_CHARS) for k, v in meta.labels
    ):
        raise InvalidRequest(f"labels: keys must hold 1..{MAX_LABEL_CHARS} chars, values <= that")
    if not 0 < meta.payload_nbytes <= limits.max_payload_nbytes:
        raise InvalidRequest(
            f"payload_nbytes {meta.payload_nbytes} not in [1, {limits.max_payload_nbytes}]"
        )
    if meta.layer_end > limits.max_layers or any(
        b >= limits.max_layers for b in meta.boundary_layers
    ):
        raise InvalidRequest(f"layers must be < {limits.max_layers}")
    if len(meta.index_text) > limits.max_index_text_chars:
        raise InvalidRequest(
            f"index_text holds {len(meta.index_text)} chars > {limits.max_index_text_chars}"
        )
    if len(meta.labels) > limits.max_labels:
        raise InvalidRequest(f"{len(meta.labels)} labels > limit {limits.max_labels}")
    check_chain(meta)
    ttl_s = meta.ttl_s if meta.ttl_s is not None else limits.default_ttl_s
    return replace(meta, ttl_s=ttl_s, created_at_s=time.time())


def check_chain(meta: SegmentMeta) -> None:
    """Keys must be the hashes of the tokens they name (else a writer could poison a key)."""
    if context_key(meta.parent_key, meta.token_ids) != meta.context_key:
        raise InvalidRequest(
            f"context_key {meta.segment_id} is not context_key(parent_key, token_ids)"
        )
    if content_key(meta.token_ids) != meta.content_key:
        raise InvalidRequest("content_key is not content_key(token_ids)")
    if meta.parent_key == root_key(meta.model_fingerprint) and meta.start_position != 0:
        raise InvalidRequest(
            f"a segment chained from the root starts at 0, not {meta.start_position}"
        )
