"""Anchors from what the engine computed: a refused run's in-context K/V against its stored base.

For each `AnchorSpec` (runs the anchor gate refused, since recomputed in the request's
context) the forward thread only copies the runs' blocks out; on a background putter
(`storeclient.put_queue`) each run's stored K/V is fetched and checked (`SegmentFetch`),
decoded and moved to the run's position (`kvmath.fused_decode.decode_into`, the loads'
one path: naive's K/V, the base), and the anchor (base, and in-context − base as this
context's offsets: `kvmath.anchors.kv_offset`) is put with PutAnchor. A full queue or
a failed put costs a future correction, never the request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvsplice.common.keys import content_key
from kvsplice.integrations.vllm.anchor_loads import context_pool_id
from kvsplice.integrations.vllm.chunk_putter import token_major
from kvsplice.integrations.vllm.paged_caches import PagedCaches
from kvsplice.integrations.vllm.segment_fetch import SegmentFetch
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.integrations.vllm.transfer_specs import AnchorSpec, LoadSpec
from kvsplice.kvmath.anchor_payload import encode_base, encode_offsets
from kvsplice.kvmath.anchors import AgentOffsets, kv_offset
from kvsplice.kvmath.fused_decode import decode_into
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.storeclient.put_queue import PutQueue

MAX_PENDING_ANCHORS = 8  # requests' anchors waiting for the putter (more are dropped)


@dataclass(frozen=True)
class _Gathered:
    spec: AnchorSpec
    blocks: tuple[torch.Tensor, ...]  # per layer, as `PagedCaches.copy_out` gives them


class AnchorSaver:
    def __init__(
        self, paged: PagedCaches, fetch: SegmentFetch, rope: Callable[[], RopeSpec], quant: str,
        faults: FaultLog,
    ) -> None:  # fmt: skip
        self.paged, self.fetch, self.faults = paged, fetch, faults
        self._rope = rope
        self.quant = quant  # the payloads' scheme (the connector's `quant`)
        self.num_put = 0
        self.num_dropped = 0
        self._puts = PutQueue(self._handle, MAX_PENDING_ANCHORS, name="kvsplice-anchors")

    def submit(self, spec: AnchorSpec) -> None:
        """Copy the runs' blocks out now (this step's K/V) and queue the anchors (never raises)."""
        try:
            blocks = self.paged.copy_out(spec.block_ids)
        except Exception as error:
            self.faults.record("copying an anchor's blocks out failed", error)
            return
        if not self._puts.offer(_Gathered(spec, blocks)):
            self.num_dropped += 1

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self._puts.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self._puts.close(timeout_s)

    def _handle(self, gathered: _Gathered) -> None:
        spec = gathered.spec
        first_position = spec.spans[0].start // spec.block_size * spec.block_size
        real = token_major(gathered.blocks, self.paged.layout, first_position)
        pool_id = context_pool_id(spec.token_ids, spec.spans[0].start)
        for span in spec.spans:
            try:
                self._put(spec, span, real, pool_id)
            except Exception as error:  # a lost anchor costs a later correction only
                self.faults.record(f"making an anchor failed ({type(error).__name__})", error)

    def _put(self, spec: AnchorSpec, span: ReusedSpan, real: SegmentKV, pool_id: str) -> None:
        """One run's anchor: its base (the stored run at the run's position) and this
        context's offset (in-context K/V − base), fp32 before the payloads' scheme."""
        lo = span.start - real.start_position
        in_context = real.tokens(lo, lo + span.num_tokens)
        base = self._base(spec, span, in_context.keys.shape)
        offsets = AgentOffsets(kv_offset(in_context, base, self._rope()))
        tokens = spec.token_ids[span.start : span.end]
        store = self.fetch.clients.for_namespace(spec.namespace)
        stored = store.put_anchor(
            spec.root, pool_id, content_key(tokens).hex(),
            encode_base(base, fingerprint=spec.root, quant=self.quant),
            {pool_id: encode_offsets(offsets, fingerprint=spec.root, quant=self.quant)},
            len(tokens),
        )  # fmt: skip
        self.num_put += stored is not None

    def _base(self, spec: AnchorSpec, span: ReusedSpan, shape: torch.Size) -> SegmentKV:
        """The stored run, checked against the request's tokens, moved to `span.start`."""
        load = LoadSpec(
            spec.request_id, spec.namespace, spec.root, span.start, span.end, (),
            spec.token_ids, (),
        )  # fmt: skip
        stored = self.fetch.span(load, span).tokens(span.offset, span.offset + span.num_tokens)
        keys = torch.empty(shape, dtype=torch.float32)
        values = torch.empty(shape, dtype=torch.float32)
        decode_into(stored, self._rope(), span.delta, keys, values)
        return SegmentKV(keys, values, start_position=span.start)
