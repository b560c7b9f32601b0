"""The connector's worker half: loads promised blocks from the sidecar, saves new chunks.

`load` fetches each stored piece (in place on the sidecar's host, else over gRPC),
checks it is the chain link the scheduler promised (parent, position, tokens,
fingerprint, checksum) and only then writes all layers' blocks; any fault marks
the request's blocks from the first bad one on as failed (vLLM recomputes them),
taints them so no chunk computed over them is saved until the scheduler has heard
of the fault, and deletes a piece that failed verification. `save` copies a chunk's
blocks out and hands them to the background putter. What became of both goes back
to the scheduler as `WorkerNews`. A load's approximate runs (`LoadSpec.spans`) are
checked token by token against the request, their keys moved to the new positions
(`RopeSpec.shift_layers`, exact RoPE Δ) and written after its exact pieces (on an engine
started as a negative control, damaged first: `negative_controls`).
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections.abc import Callable, Mapping

import torch

from kvsplice.common.errors import KvspliceError
from kvsplice.common.keys import continues
from kvsplice.common.reuse_report import ReusedRun
from kvsplice.integrations.vllm.async_loads import AsyncLoads
from kvsplice.integrations.vllm.block_layout import BlockLayout, UnsupportedLayout
from kvsplice.integrations.vllm.chunk_putter import ChunkPutter, GatheredChunk
from kvsplice.integrations.vllm.negative_controls import damage
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.integrations.vllm.transfer_specs import (
    LoadFaultNews,
    LoadSpec,
    RequestStart,
    SaveSpec,
    StoredPiece,
    WorkerNews,
)
from kvsplice.kvmath.fused_decode import stored_tensors
from kvsplice.kvmath.payload import decode_stored
from kvsplice.kvmath.rope import RopeSpec

logger = logging.getLogger(__name__)


class LoadFault(Exception):
    """A stored piece could not be used: the tokens from `position` on are recomputed.

    `corrupt_segment_id` names a piece that was there but failed verification."""

    def __init__(self, position: int, reason: str, corrupt_segment_id: str | None = None) -> None:
        super().__init__(f"at token {position}: {reason}")
        self.position = position
        self.corrupt_segment_id = corrupt_segment_id


class WorkerSide:
    def __init__(
        self,
        clients: StoreClients,
        fingerprint: str,
        block_size: int,
        caches: Mapping[str, torch.Tensor],
        layout: BlockLayout,
        quant: str,
        max_pending_saves: int,
        faults: FaultLog,
        rope: Callable[[], RopeSpec] | None = None,
        negative_control: str | None = None,
    ) -> None:
        self.clients = clients
        self.negative_control = negative_control  # bench only: approximate runs damaged
        self._rope_of = rope  # the model's RoPE, read when a first approximate run is moved
        self._rope: RopeSpec | None = None
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.caches = [caches[name] for name in sorted(caches, key=layer_index)]
        _check_same_shapes(self.caches)
        self.layout = layout
        self.faults = faults
        self.putter = ChunkPutter(clients, quant, max_pending_saves, self._put_outcome, faults)
        self.blocks_per_block = block_size // layout.block_size  # kernel blocks per vLLM block
        self.num_loaded_tokens = 0
        self.num_failed_loads = 0
        self.num_withheld_saves = 0
        self.num_stored_chunks = 0  # acknowledged by the sidecar
        self.num_failed_saves = 0
        self._loaded_runs: dict[str, list[ReusedRun]] = {}  # request id -> this step's load
        self._news = WorkerNews()
        # NOTE: guards news, faults and taints: async loads fail on the loader thread
        self._news_lock = threading.Lock()
        self._num_faults = 0
        self._tainted: dict[int, int] = {}  # block id -> the fault (count) that tainted it
        self.async_loads = AsyncLoads(self.load)

    def load(self, spec: LoadSpec) -> set[int]:
        """Write tokens `[spec.start, spec.end)`; returns the block ids that could not be loaded.

        Each piece is written as soon as it is verified, straight from the payload's bytes
        (in place on the sidecar's host) into the blocks: no decoded copy, no concatenation.
        Blocks before the first bad piece stay written; the rest are reported failed.
        """
        written = [0]  # blocks of spec.block_ids written so far
        try:
            fault = self._write_pieces(spec, written)
        except LoadFault as error:
            fault = error
        except Exception as error:  # a bug or an unexpected status: recompute the rest
            position = spec.start + written[0] * self.block_size
            fault = LoadFault(position, f"loading failed: {error!r}")
        num_good = written[0]
        if num_good:
            self.num_loaded_tokens += num_good * self.block_size
            self._loaded_runs[spec.request_id] = self._runs(
                spec, spec.start + num_good * self.block_size
            )
        if fault is None:
            return set()
        return self._failed(spec, num_good, fault)

    def _write_pieces(self, spec: LoadSpec, written: list[int]) -> LoadFault | None:
        """Fetch, verify and write each piece in turn, counting written blocks in `written[0]`.

        Raises LoadFault at the first piece that cannot be used."""
        position = spec.start
        for piece in spec.pieces:
            keys, values = self._fetch_piece(spec, piece)  # each [L, H_kv, T, D]
            lo = position - piece.start
            hi = min(spec.end, piece.start + piece.num_tokens) - piece.start
            first = written[0]
            num_blocks = (hi - lo) // self.block_size  # pieces and spec are block-aligned
            self._scatter(
                spec.block_ids[first : first + num_blocks],
                keys[:, :, lo:hi], values[:, :, lo:hi],
            )  # fmt: skip
            written[0] = first + num_blocks
            position = piece.start + hi
        if spec.spans and position < spec.end:
            self._write_spans(spec, position, written)
            position = spec.end
        if position != spec.end:
            return LoadFault(position, f"the stored run ends at {position}, {spec.end} promised")
        return None

    def _write_spans(self, spec: LoadSpec, position: int, written: list[int]) -> None:
        """Tokens `[position, spec.end)` from the spec's approximate runs: each run's tokens
        checked against the request's, its keys moved by its Δ, then the blocks written."""
        spans = spec.spans
        if spans[0].start != position or any(
            a.end != b.start for a, b in itertools.pairwise(spans)
        ) or spans[-1].end < spec.end:  # fmt: skip
            raise LoadFault(position, "the approximate runs do not cover the promised tokens")
        cache = self.caches[0]  # NOTE: runs are moved where the cache is (a GPU rotates them)
        shape = (len(self.caches), self.layout.num_kv_heads, spec.end - position)
        keys_out = torch.empty(
            (*shape, self.layout.head_dim), dtype=cache.dtype, device=cache.device
        )
        values_out = torch.empty_like(keys_out)
        for span in spans:
            keys, values = self._fetch_span(spec, span)
            lo, hi = span.start - position, min(span.end, spec.end) - position
            run = slice(span.offset, span.offset + hi - lo)
            stored = keys[:, :, run].to(cache.device)
            moved = stored
            if span.delta:
                moved = self._rope_spec().shift_layers(stored.float(), span.delta)
            run_values = values[:, :, run]
            if self.negative_control is not None:
                seed = f"{span.segment_id}:{span.offset}:{span.start}"
                moved, run_values = damage(self.negative_control, stored, moved, run_values, seed)
            keys_out[:, :, lo:hi].copy_(moved)
            values_out[:, :, lo:hi].copy_(run_values)
        first = written[0]
        num_blocks = (spec.end - position) // self.block_size
        self._scatter(spec.block_ids[first : first + num_blocks], keys_out, values_out)
        written[0] = first + num_blocks

    def _rope_spec(self) -> RopeSpec:
        if self._rope is None:
            if self._rope_of is None:
                raise LoadFault(0, "this worker cannot move keys (no RoPE given)")
            self._rope = self._rope_of()
        return self._rope

    def _fetch_span(self, spec: LoadSpec, span: ReusedSpan) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's segment K and V `[L, H_kv, T, D]`, once its tokens proved to be the
        request's (`offset` on) and its payload its meta's."""
        store = self.clients.for_namespace(spec.namespace)
        try:
            found = store.get_segment(span.segment_id, model_fingerprint=spec.root)
        except KvspliceError as error:
            raise LoadFault(span.start, f"get_segment failed: {error}") from error
        if found is None:
            raise LoadFault(span.start, f"segment {span.segment_id} is gone or unreachable")
        meta, payload = found
        run = meta.token_ids[span.offset : span.offset + span.num_tokens]
        if tuple(run) != spec.token_ids[span.start : span.end]:
            raise LoadFault(span.start, f"segment {span.segment_id} holds other tokens")
        try:
            stored = decode_stored(payload, expect_fingerprint=spec.root, verified=True)
        except KvspliceError as error:
            raise LoadFault(span.start, f"segment {span.segment_id}: {error}") from error
        if stored.layer_start != 0 or stored.kv_shape[:2] != (
            len(self.caches), self.layout.num_kv_heads
        ) or stored.kv_shape[3] != self.layout.head_dim:  # fmt: skip
            raise LoadFault(span.start, f"segment {span.segment_id} holds {stored.kv_shape}")
        return stored_tensors(stored, self.caches[0].dtype)

    def _failed(self, spec: LoadSpec, num_good: int, fault: LoadFault) -> set[int]:
        """Report the blocks from the first bad one on, taint them, tell the scheduler."""
        self.num_failed_loads += 1
        self.faults.record("load failed", f"request {spec.request_id}: {fault}")
        if fault.corrupt_segment_id is not None:
            self._delete(spec.namespace, fault.corrupt_segment_id)
        failed = set(spec.block_ids[num_good:])
        position = spec.start + num_good * self.block_size
        news = LoadFaultNews(spec.request_id, spec.namespace, position, fault.corrupt_segment_id)
        with self._news_lock:
            self._num_faults += 1
            for block_id in failed:
                self._tainted[block_id] = self._num_faults
            self._news.faults.append(news)
        return failed

    def _delete(self, namespace: str, segment_id: str) -> None:
        """Remove a segment that failed verification (a reader's token may not: then the
        scheduler's own list keeps it from being promised)."""
        try:
            self.clients.for_namespace(namespace).delete(segment_id)
        except Exception as error:
            self.faults.record("deleting a corrupt segment failed", error)

    def report(self, start: RequestStart) -> None:
        """Tell the sidecar what this request reused (queued; sent by a background flush), so
        its stats count every token the engine loaded, and where it was served from."""
        runs = self._loaded_runs.pop(start.request_id, [])
        try:
            store = self.clients.for_namespace(start.namespace)
            store.report_reuse(start.num_prompt_tokens, runs)
        except Exception as error:
            self.faults.record("reporting reuse failed", error)

    def take_news(self, num_faults_seen: int) -> WorkerNews:
        """What happened since the last call; forgets taints the scheduler has heard of."""
        with self._news_lock:
            if self._tainted:
                self._tainted = {b: f for b, f in self._tainted.items() if f > num_faults_seen}
            news, self._news = self._news, WorkerNews()
        return news

    def _put_outcome(self, spec: SaveSpec, stored: bool) -> None:
        with self._news_lock:
            if stored:
                self.num_stored_chunks += 1
            else:
                self.num_failed_saves += 1
            (self._news.acked if stored else self._news.failed).append((spec.namespace, spec.key))

    def _runs(self, spec: LoadSpec, end: int) -> list[ReusedRun]:
        """The loaded tokens `[spec.start, end)` per stored piece or run read (each a read
        of its segment), with where each was read and whether it was exact."""
        store = self.clients.for_namespace(spec.namespace)
        runs = []
        for piece in spec.pieces:
            lo, hi = max(spec.start, piece.start), min(end, piece.start + piece.num_tokens)
            if lo < hi:
                key = bytes.fromhex(piece.segment_id)
                runs.append(ReusedRun(hi - lo, store.served_from(key), key))
        for span in spec.spans:  # approximate: computed at another position or prefix
            lo, hi = span.start, min(end, span.end)
            if lo < hi:
                key = bytes.fromhex(span.segment_id)
                runs.append(ReusedRun(hi - lo, store.served_from(key), key, exact=False))
        return runs

    def save(self, spec: SaveSpec, num_faults_seen: int) -> None:
        """Copy the chunk's blocks out now (this step's K/V, one copy) and queue the put.

        NOTE: a chunk computed over a block that failed to load (its own request's, or a
        block it shares through vLLM's prefix cache) is withheld: it was planned before
        the scheduler heard of the fault, and its K/V attended to unwritten blocks.
        """
        if self._tainted and self._computed_over_a_fault(spec, num_faults_seen):
            self.num_withheld_saves += 1
            self._put_outcome(spec, False)
            return
        try:
            block_ids = self._kernel_blocks(spec.block_ids)
            blocks = tuple(
                cache.index_select(0, block_ids.to(cache.device)).cpu() for cache in self.caches
            )
        except Exception as error:
            self.faults.record("copying a chunk out failed", error)
            self._put_outcome(spec, False)
            return
        self.putter.submit(GatheredChunk(spec, blocks, self.layout))

    def _computed_over_a_fault(self, spec: SaveSpec, num_faults_seen: int) -> bool:
        with self._news_lock:
            return any(self._tainted.get(b, 0) > num_faults_seen for b in spec.context_block_ids)

    def _fetch_piece(self, spec: LoadSpec, piece: StoredPiece) -> tuple[torch.Tensor, torch.Tensor]:
        """The piece's K and V `[L, H_kv, T, D]` once it proved the promised chain link:
        views of the payload when it holds the cache's dtype, else decoded once."""
        store = self.clients.for_namespace(spec.namespace)
        corrupt_before = store.counters.num_corrupt_payloads
        try:
            found = store.get_segment(piece.segment_id, model_fingerprint=spec.root)
        except KvspliceError as error:
            raise LoadFault(piece.start, f"get_segment failed: {error}") from error
        if found is None:
            corrupt = store.counters.num_corrupt_payloads != corrupt_before
            state = "corrupt" if corrupt else "gone or unreachable"
            raise LoadFault(
                piece.start, f"segment {piece.segment_id} is {state}",
                piece.segment_id if corrupt else None,
            )  # fmt: skip
        meta, payload = found
        tokens = spec.token_ids[piece.start : piece.start + piece.num_tokens]
        if not continues(meta, piece.parent_key, tokens, piece.start):
            raise LoadFault(
                piece.start,
                f"segment {piece.segment_id} is not the promised chain link",
                piece.segment_id,
            )
        try:
            # NOTE: `get_segment` matched these bytes to the meta's checksum already
            stored = decode_stored(payload, expect_fingerprint=spec.root, verified=True)
        except KvspliceError as error:
            raise LoadFault(
                piece.start, f"segment {piece.segment_id}: {error}", piece.segment_id
            ) from error
        expected = (
            len(self.caches),
            self.layout.num_kv_heads,
            piece.num_tokens,
            self.layout.head_dim,
        )
        if stored.kv_shape != expected or stored.layer_start != 0:
            raise LoadFault(
                piece.start,
                f"segment {piece.segment_id} holds {stored.kv_shape}, expected {expected}",
                piece.segment_id,
            )
        return stored_tensors(stored, self.caches[0].dtype)

    def _scatter(self, block_ids: tuple[int, ...], k: torch.Tensor, v: torch.Tensor) -> None:
        kernel_ids = self._kernel_blocks(block_ids)
        for layer, cache in enumerate(self.caches):
            self.layout.scatter(cache, kernel_ids, k[layer], v[layer])

    def _kernel_blocks(self, block_ids: tuple[int, ...]) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if self.blocks_per_block == 1:
            return ids
        offsets = torch.arange(self.blocks_per_block, dtype=torch.int64)
        return (ids.view(-1, 1) * self.blocks_per_block + offsets).reshape(-1)


def _check_same_shapes(caches: list[torch.Tensor]) -> None:
    """Every layer's cache alike: a chunk is one `[L, H_kv, T, D]` tensor."""
    shapes = {(tuple(c.shape), c.dtype) for c in caches}
    if len(shapes) > 1:
        raise UnsupportedLayout(
            f"layers have different KV cache shapes: {sorted(map(str, shapes))}"
        )


def layer_index(layer_name: str) -> int:
    """The decoder layer a vLLM attention layer name belongs to (`model.layers.12.self_attn.attn`)."""
    numbers = re.findall(r"\.(\d+)\.", f".{layer_name}.")
    if not numbers:
        raise ValueError(f"cannot tell the layer index of {layer_name!r}")
    return int(numbers[0])
