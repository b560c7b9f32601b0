"""The connector's worker half: loads promised blocks from the sidecar, saves new chunks.

`load` fetches each stored piece (in place on the sidecar's host, else over gRPC),
checks it is the chain link the scheduler promised (parent, position, tokens,
fingerprint, checksum) and only then writes all layers' blocks; any fault marks
the request's blocks from the first bad one on as failed (vLLM recomputes them),
taints them so no chunk computed over them is saved until the scheduler has heard
of the fault, and deletes a piece that failed verification. `save` copies a chunk's
blocks out and hands them to the background putter. What became of both goes back
to the scheduler as `WorkerNews`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping

import torch

from kvsplice.common.errors import KvspliceError
from kvsplice.common.keys import continues
from kvsplice.common.reuse_report import ReusedRun
from kvsplice.integrations.vllm.block_layout import BlockLayout, UnsupportedLayout
from kvsplice.integrations.vllm.chunk_putter import ChunkPutter, GatheredChunk
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.integrations.vllm.transfer_specs import (
    LoadFaultNews,
    LoadSpec,
    RequestStart,
    SaveSpec,
    StoredPiece,
    WorkerNews,
)
from kvsplice.kvmath.payload import decode_payload
from kvsplice.kvmath.segment_kv import SegmentKV

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
    ) -> None:
        self.clients = clients
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
        self._loaded_runs: dict[str, list[ReusedRun]] = {}  # request id -> this step's load
        self._news = WorkerNews()
        self._news_lock = threading.Lock()
        self._num_faults = 0
        self._tainted: dict[int, int] = {}  # block id -> the fault (count) that tainted it

    def load(self, spec: LoadSpec) -> set[int]:
        """Write tokens `[spec.start, spec.end)`; returns the block ids that could not be loaded.

        Blocks before the first bad piece are written; the rest are reported failed.
        """
        try:
            k, v, fault = self._fetch_range(spec)
        except Exception as error:  # a bug or an unexpected status: recompute it all
            k, v, fault = None, None, LoadFault(spec.start, f"fetch failed: {error!r}")
        num_good = k.shape[2] // self.block_size if k is not None else 0
        if num_good:
            n = num_good * self.block_size
            try:
                self._scatter(spec.block_ids[:num_good], k[:, :, :n], v[:, :, :n])  # type: ignore[index]
                self.num_loaded_tokens += n
                self._loaded_runs[spec.request_id] = self._runs(spec, spec.start + n)
            except Exception as error:
                num_good, fault = 0, LoadFault(spec.start, f"writing blocks failed: {error!r}")
        if fault is None:
            return set()
        return self._failed(spec, num_good, fault)

    def _failed(self, spec: LoadSpec, num_good: int, fault: LoadFault) -> set[int]:
        """Report the blocks from the first bad one on, taint them, tell the scheduler."""
        self.num_failed_loads += 1
        self.faults.record("load failed", f"request {spec.request_id}: {fault}")
        if fault.corrupt_segment_id is not None:
            self._delete(spec.namespace, fault.corrupt_segment_id)
        failed = set(spec.block_ids[num_good:])
        self._num_faults += 1
        for block_id in failed:
            self._tainted[block_id] = self._num_faults
        position = spec.start + num_good * self.block_size
        news = LoadFaultNews(spec.request_id, spec.namespace, position, fault.corrupt_segment_id)
        with self._news_lock:
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
        if self._tainted:
            self._tainted = {b: f for b, f in self._tainted.items() if f > num_faults_seen}
        with self._news_lock:
            news, self._news = self._news, WorkerNews()
        return news

    def _put_outcome(self, spec: SaveSpec, stored: bool) -> None:
        with self._news_lock:
            (self._news.acked if stored else self._news.failed).append((spec.namespace, spec.key))

    def _runs(self, spec: LoadSpec, end: int) -> list[ReusedRun]:
        """The loaded tokens `[spec.start, end)` per stored piece, with where each was read."""
        store = self.clients.for_namespace(spec.namespace)
        runs = []
        for piece in spec.pieces:
            lo, hi = max(spec.start, piece.start), min(end, piece.start + piece.num_tokens)
            if lo < hi:
                key = bytes.fromhex(piece.segment_id)
                whole = (lo, hi) == (piece.start, piece.start + piece.num_tokens)
                runs.append(ReusedRun(hi - lo, store.served_from(key), key if whole else None))
        return runs

    def save(self, spec: SaveSpec, num_faults_seen: int) -> None:
        """Copy the chunk's blocks out now (this step's K/V) and queue the put.

        NOTE: a chunk computed over a block that failed to load (its own request's, or a
        block it shares through vLLM's prefix cache) is withheld: it was planned before
        the scheduler heard of the fault, and its K/V attended to unwritten blocks.
        """
        if self._tainted and any(
            self._tainted.get(b, 0) > num_faults_seen for b in spec.context_block_ids
        ):
            self.num_withheld_saves += 1
            self._put_outcome(spec, False)
            return
        try:
            block_ids = self._kernel_blocks(spec.block_ids)
            keys, values = [], []
            for cache in self.caches:
                k, v = self.layout.gather(cache, block_ids)
                keys.append(k.cpu())
                values.append(v.cpu())
            kv = SegmentKV(torch.stack(keys), torch.stack(values), start_position=spec.start)
        except Exception as error:
            self.faults.record("copying a chunk out failed", error)
            self._put_outcome(spec, False)
            return
        self.putter.submit(GatheredChunk(spec, kv))

    def _fetch_range(
        self, spec: LoadSpec
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, LoadFault | None]:
        """K/V `[L, H_kv, n, D]` of the first n promised tokens, and the fault that ended
        the run early (None when all `end - start` tokens were fetched)."""
        dtype = self.caches[0].dtype
        parts_k, parts_v, position, fault = [], [], spec.start, None
        for piece in spec.pieces:
            try:
                kv = self._fetch_piece(spec, piece, dtype)
            except LoadFault as error:
                fault = error
                break
            lo = position - piece.start
            hi = min(spec.end, piece.start + piece.num_tokens) - piece.start
            parts_k.append(kv.keys[:, :, lo:hi])
            parts_v.append(kv.values[:, :, lo:hi])
            position = piece.start + hi
        if fault is None and position != spec.end:
            fault = LoadFault(position, f"the stored run ends at {position}, {spec.end} promised")
        if not parts_k:
            return None, None, fault
        return torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2), fault

    def _fetch_piece(self, spec: LoadSpec, piece: StoredPiece, dtype: torch.dtype) -> SegmentKV:
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
            kv = decode_payload(payload, expect_fingerprint=spec.root, dtype=dtype)
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
        if tuple(kv.keys.shape) != expected or kv.layer_start != 0:
            raise LoadFault(
                piece.start,
                f"segment {piece.segment_id} holds {tuple(kv.keys.shape)}, expected {expected}",
                piece.segment_id,
            )
        return kv

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
