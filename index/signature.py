"""MinHash signatures of segments: shingling, hashing, and their persisted bytes.

A segment is signed from its canonical text (word k-grams) when it has text,
else from its token ids (token k-grams). Indexing and ranking live in
`similarity_index`; this module knows nothing about LSH buckets.
"""

from __future__ import annotations

import enum
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash
from datasketch import LeanMinHash, MinHash

from kvsplice.common.segment import SegmentMeta
from kvsplice.index.canonical import CANONICAL_VERSION, canonical_words

logger = logging.getLogger(__name__)

SIGNATURE_VERSION = 1
_MAGIC = b"KVSG"
_HEADER = struct.Struct("<4sBBI")  # magic, version, kind, config tag
_SCHEME = "affine32"
_BYTEORDER = "<"
_MIX_MUL = np.uint64(0x9E3779B97F4A7C15)


class SignatureKind(enum.IntEnum):
    """What a signature was shingled from; signatures of different kinds never compare."""

    TEXT = 1
    TOKENS = 2


@dataclass(frozen=True)
class Signature:
    kind: SignatureKind
    minhash: LeanMinHash


def _identity(value: int) -> int:
    # Shingles arrive already hashed to uint32 (see `_shingle_hashes`).
    return value


def _mix64(h: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, element-wise (uint64 wraps by design)."""
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def _shingle_hashes(units: np.ndarray, k: int) -> np.ndarray:
    """uint32 hashes of every k-gram of `units` (uint64); one gram if fewer than k units.

    A polynomial over the k units (uint64 arithmetic wraps by design), mixed once.
    """
    k = min(k, len(units))
    num_grams = len(units) - k + 1
    h = units[:num_grams].copy()
    for j in range(1, k):
        h = h * _MIX_MUL + units[j : j + num_grams]
    h = _mix64(h)
    return (h ^ (h >> np.uint64(32))).astype(np.uint32)


class Signer:
    """Builds MinHash signatures with fixed parameters; safe to share."""

    def __init__(
        self, *, num_perm: int, seed: int, text_shingle_words: int, token_shingle_tokens: int
    ) -> None:
        self.num_perm = num_perm
        self.seed = seed
        self.text_shingle_words = text_shingle_words
        self.token_shingle_tokens = token_shingle_tokens
        # Permutations are drawn once and shared by every MinHash built here.
        self._permutations = MinHash(num_perm=num_perm, seed=seed, scheme=_SCHEME).permutations
        params = f"{num_perm}/{seed}/{text_shingle_words}/{token_shingle_tokens}"
        tag = f"{params}/{CANONICAL_VERSION}/{SIGNATURE_VERSION}"
        self._config_tag = xxhash.xxh32_intdigest(tag.encode())
        self._num_signature_bytes = _HEADER.size + struct.calcsize(f"<qiB{num_perm}I")

    def sign_meta(self, meta: SegmentMeta) -> Signature:
        """Text signature when `meta.index_text` has words, else token signature."""
        return self.sign_text(meta.index_text) or self.sign_tokens(meta.token_ids)

    def sign_text(self, text: str) -> Signature | None:
        """Signature of the canonical words of `text`; `None` when it has none."""
        words = canonical_words(text) if text else []
        if not words:
            return None
        units = np.fromiter(
            (xxhash.xxh3_64_intdigest(w.encode()) for w in words), np.uint64, len(words)
        )
        return self._sign(SignatureKind.TEXT, _shingle_hashes(units, self.text_shingle_words))

    def sign_tokens(self, token_ids: Sequence[int]) -> Signature:
        units = np.asarray(token_ids, dtype=np.uint64)
        if units.size == 0:
            raise ValueError("cannot sign an empty token sequence")
        return self._sign(SignatureKind.TOKENS, _shingle_hashes(units, self.token_shingle_tokens))

    def _sign(self, kind: SignatureKind, shingle_hashes: np.ndarray) -> Signature:
        minhash = MinHash(
            num_perm=self.num_perm,
            seed=self.seed,
            hashfunc=_identity,
            permutations=self._permutations,
            scheme=_SCHEME,
        )
        minhash.update_batch(shingle_hashes.tolist())
        return Signature(kind, LeanMinHash(minhash))

    def to_bytes(self, signature: Signature) -> bytes:
        """Versioned bytes: header (magic, version, kind, config tag) + LeanMinHash."""
        body = bytearray(signature.minhash.bytesize(_BYTEORDER))
        signature.minhash.serialize(body, _BYTEORDER)
        return _HEADER.pack(_MAGIC, SIGNATURE_VERSION, signature.kind, self._config_tag) + body

    def from_bytes(self, data: bytes) -> Signature | None:
        """The signature in `data`, or `None` when it is malformed or was built
        with other parameters (the caller re-signs from the segment then)."""
        if len(data) != self._num_signature_bytes:
            return None
        magic, version, kind, tag = _HEADER.unpack_from(data)
        if magic != _MAGIC or version != SIGNATURE_VERSION or tag != self._config_tag:
            return None
        if kind not in SignatureKind.__members__.values():
            return None
        try:
            minhash = LeanMinHash.deserialize(data[_HEADER.size :], _BYTEORDER)
        except ValueError:
            logger.warning("signature bytes with a valid header failed to parse; re-signing")
            return None
        if minhash.scheme != _SCHEME or len(minhash) != self.num_perm or minhash.seed != self.seed:
            return None
        return Signature(SignatureKind(kind), minhash)
