"""Fetching a stored segment for a load, and proving it is the promised one before any value is used.

One path for both kinds of loaded run: a `StoredPiece` (an exact chain link: parent,
position and every token) and a `ReusedSpan` (a run found by content: its tokens). Both
are fetched (in place on the sidecar's host, else over gRPC), checked, decoded to their
stored form (`StoredKV`, views of the payload) and checked for this engine's shape; any
failure is a `LoadFault`. Knows the store client and records, not caches or tensors' uses.
"""

from __future__ import annotations

from collections.abc import Callable

from kvsplice.common.errors import KvspliceError
from kvsplice.common.keys import continues
from kvsplice.common.segment import SegmentMeta
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.integrations.vllm.transfer_specs import LoadSpec, StoredPiece
from kvsplice.kvmath.payload import StoredKV, decode_stored

MismatchFn = Callable[[SegmentMeta], str | None]  # why the meta is not the promised one


class LoadFault(Exception):
    """A stored piece could not be used: the tokens from `position` on are recomputed.

    `corrupt_segment_id` names a piece that was there but failed verification; `missing`:
    the promised segment was gone (evicted or deleted since the lookup, or unreachable)."""

    def __init__(
        self, position: int, reason: str, corrupt_segment_id: str | None = None,
        *, missing: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(f"at token {position}: {reason}")
        self.position = position
        self.corrupt_segment_id = corrupt_segment_id
        self.missing = missing


class SegmentFetch:
    def __init__(self, clients: StoreClients, kv_dims: tuple[int, int, int]) -> None:
        self.clients = clients
        self.kv_dims = kv_dims  # (L, H_kv, D) of this engine's caches

    def piece(self, spec: LoadSpec, piece: StoredPiece) -> StoredKV:
        """The piece once it proved the promised chain link. A piece that fails is corrupt
        (its id is its chain link's key: a segment under it holding anything else lies)."""
        tokens = spec.token_ids[piece.start : piece.start + piece.num_tokens]

        def mismatch(meta: SegmentMeta) -> str | None:
            linked = continues(meta, piece.parent_key, tokens, piece.start)
            return None if linked else "is not the promised chain link"

        return self._verified(spec, piece.segment_id, piece.start, mismatch, suspect=True)

    def span(self, spec: LoadSpec, span: ReusedSpan) -> StoredKV:
        """The run's segment once its tokens (`offset` on) proved to be the request's. A run
        that fails is only refused: it was found by content, its id promises no tokens."""
        tokens = spec.token_ids[span.start : span.end]

        def mismatch(meta: SegmentMeta) -> str | None:
            same = tuple(meta.token_ids[span.offset : span.offset + span.num_tokens]) == tokens
            return None if same else "holds other tokens"

        return self._verified(spec, span.segment_id, span.start, mismatch, suspect=False)

    def _verified(
        self, spec: LoadSpec, segment_id: str, position: int, mismatch: MismatchFn,
        *, suspect: bool,
    ) -> StoredKV:  # fmt: skip
        """The segment's K/V in stored form, its meta `mismatch`-free, its payload its meta's
        (fingerprint, checksum, shape); a fault names the segment corrupt if `suspect`."""
        store = self.clients.for_namespace(spec.namespace)
        blamed = segment_id if suspect else None
        corrupt_before = store.counters.num_corrupt_payloads
        try:
            found = store.get_segment(segment_id, model_fingerprint=spec.root)
        except KvspliceError as error:
            raise LoadFault(position, f"get_segment failed: {error}") from error
        if found is None:
            corrupt = store.counters.num_corrupt_payloads != corrupt_before
            state = "corrupt" if corrupt else "gone or unreachable"
            raise LoadFault(
                position, f"segment {segment_id} is {state}", blamed if corrupt else None,
                missing=not corrupt,
            )  # fmt: skip
        meta, payload = found
        why = mismatch(meta)
        if why is not None:
            raise LoadFault(position, f"segment {segment_id} {why}", blamed)
        try:
            # NOTE: `get_segment` matched these bytes to the meta's checksum already
            stored = decode_stored(payload, expect_fingerprint=spec.root, verified=True)
        except KvspliceError as error:
            raise LoadFault(position, f"segment {segment_id}: {error}", blamed) from error
        num_layers, num_heads, head_dim = self.kv_dims
        expected = (num_layers, num_heads, len(meta.token_ids), head_dim)
        if stored.kv_shape != expected or stored.layer_start != 0:
            raise LoadFault(
                position, f"segment {segment_id} holds {stored.kv_shape}, expected {expected}",
                blamed,
            )  # fmt: skip
        return stored
