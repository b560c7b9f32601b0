"""The connector's worker half: loads promised blocks from the sidecar, saves new chunks.

Wiring over its rooms: the engine's caches (`PagedCaches`), loads (`BlockLoader`: pieces
checked by `SegmentFetch`, approximate runs written by `SpanWriter`), loads beside the
steps (`AsyncLoads`), saves (`save` copies a chunk's blocks out, the `ChunkPutter` puts
them), anchors of runs the anchor gate refused (`AnchorSaver`), and what became of loads
and saves for the scheduler (`WorkerNewsDesk`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kvsplice.integrations.vllm.anchor_loads import AnchorCorrector, AnchorGate
from kvsplice.integrations.vllm.anchor_saves import AnchorSaver
from kvsplice.integrations.vllm.async_loads import AsyncLoads
from kvsplice.integrations.vllm.block_layout import BlockLayout
from kvsplice.integrations.vllm.block_loader import BlockLoader
from kvsplice.integrations.vllm.chunk_putter import ChunkPutter, GatheredChunk
from kvsplice.integrations.vllm.paged_caches import PagedCaches
from kvsplice.integrations.vllm.segment_fetch import SegmentFetch
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.span_writer import SpanWriter
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.integrations.vllm.transfer_specs import (
    AnchorSpec,
    LoadSpec,
    RequestStart,
    SaveSpec,
    WorkerNews,
)
from kvsplice.integrations.vllm.worker_news import WorkerNewsDesk
from kvsplice.kvmath.rope import RopeSpec


class WorkerSide:
    def __init__(
        self, clients: StoreClients, fingerprint: str, block_size: int,
        caches: Mapping[str, torch.Tensor], layout: BlockLayout, quant: str,
        max_pending_saves: int, faults: FaultLog, rope: Callable[[], RopeSpec] | None = None,
        negative_control: str | None = None, anchor_gate: AnchorGate | None = None,
    ) -> None:  # fmt: skip
        self.fingerprint = fingerprint
        self.paged = PagedCaches(caches, layout, block_size)
        self.faults = faults
        self.news = WorkerNewsDesk()
        fetch = SegmentFetch(clients, self.paged.kv_dims)
        anchors = None if rope is None else AnchorCorrector(clients, rope, anchor_gate)
        spans = SpanWriter(fetch, self.paged, rope, negative_control, anchors)
        self.loader = BlockLoader(clients, self.paged, fetch, spans, self.news, faults)
        self.async_loads = AsyncLoads(self.loader.load)
        self.putter = ChunkPutter(clients, quant, max_pending_saves, self.news.put_outcome, faults)
        self.anchor_saves = (
            None if rope is None else AnchorSaver(self.paged, fetch, rope, quant, faults)
        )
        self.num_withheld_saves = 0

    def load(self, spec: LoadSpec) -> set[int]:
        """Write the promised tokens; the block ids that could not be loaded (never raises)."""
        return self.loader.load(spec)

    def report(self, start: RequestStart) -> None:
        self.loader.report(start)

    def save(self, spec: SaveSpec, num_faults_seen: int) -> None:
        """Copy the chunk's blocks out now (this step's K/V, one copy) and queue the put.

        NOTE: a chunk computed over a block that failed to load (its own request's, or a
        block it shares through vLLM's prefix cache) is withheld: it was planned before
        the scheduler heard of the fault, and its K/V attended to unwritten blocks.
        """
        if self.news.computed_over_a_fault(spec, num_faults_seen):
            self.num_withheld_saves += 1
            self.news.put_outcome(spec, False)
            return
        try:
            blocks = self.paged.copy_out(spec.block_ids)
        except Exception as error:
            self.faults.record("copying a chunk out failed", error)
            self.news.put_outcome(spec, False)
            return
        self.putter.submit(GatheredChunk(spec, blocks, self.paged.layout))

    def save_anchors(self, spec: AnchorSpec) -> None:
        """Copy the refused runs' blocks out now (recomputed in context) and queue their
        anchors (`anchor_saves`; never raises)."""
        if self.anchor_saves is not None:
            self.anchor_saves.submit(spec)

    def close(self) -> None:
        self.async_loads.close()
        self.putter.close()
        if self.anchor_saves is not None:
            self.anchor_saves.close()

    def take_news(self, num_faults_seen: int) -> WorkerNews:
        """What happened since the last call; forgets taints the scheduler has heard of."""
        return self.news.take(num_faults_seen)

    # ---- counters (the connector's stats) ------------------------------------------------

    @property
    def num_loaded_tokens(self) -> int:
        return self.loader.num_loaded_tokens

    @property
    def num_failed_loads(self) -> int:
        return self.loader.num_failed_loads

    @property
    def num_corrupt_loads(self) -> int:
        return self.loader.num_corrupt_loads

    @property
    def num_missing_loads(self) -> int:
        return self.loader.num_missing_loads

    @property
    def num_stored_chunks(self) -> int:
        return self.news.num_stored_chunks

    @property
    def num_failed_saves(self) -> int:
        return self.news.num_failed_saves
