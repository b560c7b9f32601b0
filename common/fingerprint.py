"""The model fingerprint: one stable digest of everything that shapes KV.

It covers the architecture config, the RoPE parameters, a digest of the
weights, the tokenizer vocabulary and the KV dtype. Computing the weight and
vocabulary digests needs the model (see `kvsplice.client.model.models`); this module
only combines the parts, so the server can compare fingerprints without torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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


def is_fingerprint(value: str) -> bool:
    """Whether `value` has the shape of a fingerprint (not whether it is known)."""
    prefix = f"{FINGERPRINT_VERSION}-"
    if not value.startswith(prefix) or len(value) != len(prefix) + FINGERPRINT_HEX_LEN:
        return False
    return all(c in "0123456789abcdef" for c in value[len(prefix) :])
