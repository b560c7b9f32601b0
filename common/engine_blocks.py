"""The engine's own names for the blocks a segment holds: vLLM's prefix-cache block hashes.

A segment an engine stored may carry the block hashes its engine computed for the segment's
tokens (one per block, in order, and the hash of the block before them), so the sidecar can
publish them in the engine's KV event format. Owns their shape and limits; not the hashing
(the engine's) nor the publishing (`server.kv_event_feed`).
"""

from __future__ import annotations

# The `medium` of the KV events that name blocks kvsplice holds (engine's and sidecar's alike).
KV_EVENTS_MEDIUM = "kvsplice"
MAX_BLOCK_HASH_NBYTES = 64


def check_engine_blocks(hashes: tuple[bytes, ...], parent_hash: bytes, num_tokens: int) -> None:
    """Raise `ValueError` unless `hashes` are whole blocks of `num_tokens` tokens (none, or a
    count dividing it) of 1..`MAX_BLOCK_HASH_NBYTES` bytes each, and `parent_hash` is empty
    (the segment's first block starts the sequence) or a hash of that size."""
    if not isinstance(hashes, tuple) or not all(isinstance(h, bytes) for h in hashes):
        raise ValueError("engine_block_hashes must be a tuple of bytes")
    if hashes and num_tokens % len(hashes):
        raise ValueError(
            f"{len(hashes)} engine block hashes do not split {num_tokens} tokens into blocks"
        )
    if not isinstance(parent_hash, bytes) or len(parent_hash) > MAX_BLOCK_HASH_NBYTES:
        raise ValueError(f"engine_parent_block_hash must be at most {MAX_BLOCK_HASH_NBYTES} bytes")
    if parent_hash and not hashes:
        raise ValueError("engine_parent_block_hash without engine_block_hashes")
    bad = next((h for h in hashes if not 0 < len(h) <= MAX_BLOCK_HASH_NBYTES), None)
    if bad is not None:
        raise ValueError(
            f"an engine block hash of {len(bad)} bytes (1..{MAX_BLOCK_HASH_NBYTES} allowed)"
        )
