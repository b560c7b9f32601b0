"""A load's approximate runs into the paged caches: each run decoded and moved by its Δ in one pass.

Every run is fetched and checked token by token (`SegmentFetch.span`), then written by
`kvmath.fused_decode.decode_into` (stored int8 takes the fused dequantize-and-rotate path,
float K/V are shifted in float32 at least) into its token slice of one `[L, H_kv, T, D]`
buffer where the caches are, and the buffer goes into the blocks (`PagedCaches.scatter`).
On an engine started as a negative control the runs are damaged first (`negative_controls`);
a load in the anchor mode has them corrected, or refused, before they go in (`anchor_loads`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from kvsplice.common.reuse_modes import ANCHOR
from kvsplice.integrations.vllm.anchor_loads import AnchorCorrector
from kvsplice.integrations.vllm.negative_controls import applied_delta, damage_in_place
from kvsplice.integrations.vllm.paged_caches import PagedCaches
from kvsplice.integrations.vllm.segment_fetch import LoadFault, SegmentFetch
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.integrations.vllm.transfer_specs import LoadSpec
from kvsplice.kvmath.fused_decode import PinnedStaging, decode_into
from kvsplice.kvmath.payload import StoredKV
from kvsplice.kvmath.rope import RopeSpec


class SpanWriter:
    def __init__(
        self,
        fetch: SegmentFetch,
        paged: PagedCaches,
        rope: Callable[[], RopeSpec] | None,
        negative_control: str | None = None,
        anchors: AnchorCorrector | None = None,
    ) -> None:
        self.fetch = fetch
        self.anchors = anchors  # the anchor mode's correction (None: naive only)
        self.paged = paged
        self._rope_of = rope  # the model's RoPE, read when a first run is written
        self._rope: RopeSpec | None = None
        self.negative_control = negative_control  # bench only: runs damaged
        cuda = paged.caches[0].device.type == "cuda"
        self._staging = PinnedStaging() if cuda else None  # int8 bytes on their way to a GPU

    def write(self, spec: LoadSpec, position: int, block_ids: tuple[int, ...]) -> None:
        """Tokens `[position, spec.end)` from the spec's runs into `block_ids` (whole blocks)."""
        spans = spec.spans
        if spans[0].start != position or any(
            a.end != b.start for a, b in itertools.pairwise(spans)
        ) or spans[-1].end < spec.end:  # fmt: skip
            raise LoadFault(position, "the approximate runs do not cover the promised tokens")
        keys_out, values_out = self.paged.token_buffers(spec.end - position)
        for span in spans:
            stored = self.fetch.span(spec, span)
            lo, hi = span.start - position, min(span.end, spec.end) - position
            run = stored.tokens(span.offset, span.offset + hi - lo)
            self._place(run, span, keys_out[:, :, lo:hi], values_out[:, :, lo:hi])
        if spec.mode == ANCHOR:  # naive's K/V are the runs' bases: corrected, or refused
            if self.anchors is None:
                raise LoadFault(position, "this worker cannot correct runs (no anchor reader)")
            self.anchors.correct(spec, position, keys_out, values_out)
        self.paged.scatter(block_ids, keys_out, values_out)

    def _place(
        self, run: StoredKV, span: ReusedSpan, keys_out: torch.Tensor, values_out: torch.Tensor
    ) -> None:
        """The run's keys moved by its Δ (new − old position) and its values, into the outs
        (`[L, H_kv, T, D]` token slices of the buffer)."""
        control = self.negative_control
        delta = span.delta if control is None else applied_delta(control, span.delta)
        decode_into(run, self._rope_spec(), delta, keys_out, values_out, self._staging)
        if control is not None:
            seed = f"{span.segment_id}:{span.offset}:{span.start}"
            damage_in_place(control, keys_out, values_out, seed)

    def _rope_spec(self) -> RopeSpec:
        if self._rope is None:
            if self._rope_of is None:
                raise LoadFault(0, "this worker cannot move keys (no RoPE given)")
            self._rope = self._rope_of()
        return self._rope
