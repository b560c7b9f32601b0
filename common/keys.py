"""The key space: chained context keys (exact reuse), off-chain and base parents, content keys.

`context_key(parent, tokens)` identifies `tokens` *after exactly* the left
context that `parent` identifies; the chain starts at `root_key(fingerprint)`,
so chains of different models never meet. Two more kinds of parent never meet
a chain: `off_chain_key(parent)` (K/V computed on top of approximate reuse
after `parent`) and `sender_base_root(fingerprint)` (answers' K/V as their
senders computed them, found by content). `content_key(tokens)` identifies the
tokens alone, wherever they stand. blake2b (stdlib, 16-byte digests) keeps the
keys identical in every process, independent of PYTHONHASHSEED.

Also owns the model fingerprint the chain is rooted in (`compute_fingerprint` over
`FingerprintParts`: architecture, RoPE, weights and vocabulary digests, KV dtype; the
parts are digested by the client, which has the model, so the server compares
fingerprints without torch), and the exact key chain over a token sequence (`KeyChain`, `continues`), shared by
every engine kvsplice drives: which key names each span stored after exactly its left
context, and whether a stored segment really is the next link of a chain.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # segment.py imports this module
    from kvsplice.common.segment import SegmentMeta

# The model fingerprint.
FINGERPRINT_VERSION = "kvfp1"
FINGERPRINT_HEX_LEN = 32


@dataclass(frozen=True)
class FingerprintParts:
    """What a fingerprint is computed from; every field participates."""

    architecture: Mapping[str, Any]
    rope: Mapping[str, Any]
    weights_digest: str
    vocab_digest: str
    kv_dtype: str

    def __post_init__(self) -> None:
        if not self.weights_digest:
            raise ValueError("weights_digest must be non-empty")
        if not self.vocab_digest:
            raise ValueError("vocab_digest must be non-empty")
        if not self.kv_dtype:
            raise ValueError("kv_dtype must be non-empty")


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace: the same bytes in every process."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def compute_fingerprint(parts: FingerprintParts) -> str:
    """`kvfp1-<32 hex>`; any change of any part changes it."""
    payload = canonical_json(
        {
            "architecture": parts.architecture,
            "rope": parts.rope,
            "weights": parts.weights_digest,
            "vocab": parts.vocab_digest,
            "kv_dtype": parts.kv_dtype,
        }
    )
    digest = hashlib.blake2b(payload.encode(), digest_size=FINGERPRINT_HEX_LEN // 2)
    return f"{FINGERPRINT_VERSION}-{digest.hexdigest()}"


def derive_fingerprint(model_fingerprint: str, extras: Mapping[str, Any]) -> str:
    """A fingerprint for K/V the model computes under `extras` (a LoRA adapter, images):
    the same shape as the model's, never equal to it or to another `extras`' one."""
    payload = canonical_json({"base": model_fingerprint, "extras": extras})
    digest = hashlib.blake2b(payload.encode(), digest_size=FINGERPRINT_HEX_LEN // 2)
    return f"{FINGERPRINT_VERSION}-{digest.hexdigest()}"


def is_fingerprint(value: str) -> bool:
    """Whether `value` has the shape of a fingerprint (not whether it is known)."""
    prefix = f"{FINGERPRINT_VERSION}-"
    if not value.startswith(prefix) or len(value) != len(prefix) + FINGERPRINT_HEX_LEN:
        return False
    return all(c in "0123456789abcdef" for c in value[len(prefix) :])


# The key space.
KEY_NBYTES = 16
MAX_TOKEN_ID = 2**31 - 1

_ROOT_TAG = b"kvsplice/root/v1"
_CONTEXT_TAG = b"kvsplice/context/v1"
_CONTENT_TAG = b"kvsplice/content/v1"
_OFF_CHAIN_TAG = b"kvsplice/off-chain/v1"
_SENDER_BASE_TAG = b"kvsplice/sender-base/v1"


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Little-endian int32 encoding of token ids (the form every key hashes)."""
    encoded = array("i", token_ids)
    if encoded.itemsize != 4:  # pragma: no cover - every CPython platform we ship on
        raise RuntimeError("array('i') is not 32-bit on this platform")
    if array("i", [1]).tobytes()[0] != 1:  # pragma: no cover - big-endian host
        encoded.byteswap()
    return encoded.tobytes()


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_NBYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def root_key(model_fingerprint: str) -> bytes:
    """Parent key of a segment that starts at position 0."""
    return _digest(_ROOT_TAG, model_fingerprint.encode())


def context_key(parent_key: bytes, token_ids: Sequence[int]) -> bytes:
    """Key of `token_ids` placed right after the context `parent_key` names."""
    if len(parent_key) != KEY_NBYTES:
        raise ValueError(f"parent_key must be {KEY_NBYTES} bytes, got {len(parent_key)}")
    return _digest(_CONTEXT_TAG, parent_key, token_bytes(token_ids))


def content_key(token_ids: Sequence[int]) -> bytes:
    """Position- and context-independent key of the tokens alone."""
    return _digest(_CONTENT_TAG, token_bytes(token_ids))


def off_chain_key(parent_key: bytes) -> bytes:
    """Parent of K/V that follows context `parent_key` but not exactly (approximate reuse).

    No prompt's chain reaches it (a chain step always hashes tokens), so exact
    lookups never return approximate K/V; its own descendants chain as usual.
    """
    if len(parent_key) != KEY_NBYTES:
        raise ValueError(f"parent_key must be {KEY_NBYTES} bytes, got {len(parent_key)}")
    return _digest(_OFF_CHAIN_TAG, parent_key)


def sender_base_root(model_fingerprint: str) -> bytes:
    """Parent of answers stored as their senders computed them (anchor's sender bases)."""
    return _digest(_SENDER_BASE_TAG, model_fingerprint.encode())


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

    def peek(self, token_ids: Sequence[int]) -> ChainLink:
        """The link `extend(token_ids)` would add, the cursor left where it is."""
        end = self.position + len(token_ids)
        return ChainLink(self.position, end, self.parent, context_key(self.parent, token_ids))

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
