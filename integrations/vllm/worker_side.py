"""The connector's worker half: loads promised blocks from the sidecar, saves new chunks.

`load` fetches each stored piece (in place on the sidecar's host, else over gRPC),
checks it is the chain link the scheduler promised (parent, position, tokens,
fingerprint, checksum) and only then writes all layers' blocks; any fault marks
the request's blocks from the first bad one on as failed, and vLLM recomputes
them. `save` copies a chunk's blocks out and hands them to the background putter.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import torch

from kvsplice.common.errors import KvspliceError
from kvsplice.common.keys import continues
from kvsplice.common.reuse_report import ReusedRun
from kvsplice.integrations.vllm.block_layout import BlockLayout
from kvsplice.integrations.vllm.chunk_putter import ChunkPutter, GatheredChunk
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.integrations.vllm.transfer_specs import LoadSpec, RequestStart, SaveSpec, StoredPiece
from kvsplice.kvmath.payload import decode_payload
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)


class LoadFault(Exception):
    """A stored piece could not be used: the tokens from `position` on are recomputed."""

    def __init__(self, position: int, reason: str) -> None:
        super().__init__(f"at token {position}: {reason}")
        self.position = position


class WorkerSide:
    def __init__(
        self,
        clients: StoreClients,
        fingerprint: str,
        block_size: int,
        caches: Mapping[str, torch.Tensor],
        layout: BlockLayout,
        putter: ChunkPutter,
    ) -> None:
        self.clients = clients
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.caches = [caches[name] for name in sorted(caches, key=layer_index)]
        self.layout = layout
        self.putter = putter
        self.blocks_per_block = block_size // layout.block_size  # kernel blocks per vLLM block
        self.num_loaded_tokens = 0
        self.num_failed_loads = 0
        self._loaded_runs: dict[str, list[ReusedRun]] = {}  # request id -> this step's load

    def load(self, spec: LoadSpec) -> set[int]:
        """Write tokens `[spec.start, spec.end)`; returns the block ids that could not be loaded.

        Blocks before the first bad piece are written; the rest are reported failed.
        """
        k, v, fault = self._fetch_range(spec)
        num_good = k.shape[2] // self.block_size if k is not None else 0
        if num_good:
            n = num_good * self.block_size
            self._scatter(spec.block_ids[:num_good], k[:, :, :n], v[:, :, :n])  # type: ignore[index]
            self.num_loaded_tokens += n
            self._loaded_runs[spec.request_id] = self._runs(spec, spec.start + n)
        if fault is None:
            return set()
        self.num_failed_loads += 1
        logger.warning("request %s: %s; recomputing from there", spec.request_id, fault)
        return set(spec.block_ids[num_good:])

    def report(self, start: RequestStart) -> None:
        """Tell the sidecar what this request reused (queued; sent by a background flush), so
        its stats count every token the engine loaded, and where it was served from."""
        runs = self._loaded_runs.pop(start.request_id, [])
        self.clients.for_namespace(start.namespace).report_reuse(start.num_prompt_tokens, runs)

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

    def save(self, spec: SaveSpec) -> None:
        """Copy the chunk's blocks out now (this step's K/V) and queue the put."""
        block_ids = self._kernel_blocks(spec.block_ids)
        keys, values = [], []
        for cache in self.caches:
            k, v = self.layout.gather(cache, block_ids)
            keys.append(k.cpu())
            values.append(v.cpu())
        kv = SegmentKV(torch.stack(keys), torch.stack(values), start_position=spec.start)
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
        try:
            found = store.get_segment(piece.segment_id, model_fingerprint=self.fingerprint)
        except KvspliceError as error:
            raise LoadFault(piece.start, f"get_segment failed: {error}") from error
        if found is None:
            raise LoadFault(
                piece.start, f"segment {piece.segment_id} is gone, corrupt or unreachable"
            )
        meta, payload = found
        tokens = spec.token_ids[piece.start : piece.start + piece.num_tokens]
        if not continues(meta, piece.parent_key, tokens, piece.start):
            raise LoadFault(
                piece.start, f"segment {piece.segment_id} is not the promised chain link"
            )
        try:
            kv = decode_payload(payload, expect_fingerprint=self.fingerprint, dtype=dtype)
        except KvspliceError as error:
            raise LoadFault(piece.start, f"segment {piece.segment_id}: {error}") from error
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


def layer_index(layer_name: str) -> int:
    """The decoder layer a vLLM attention layer name belongs to (`model.layers.12.self_attn.attn`)."""
    numbers = re.findall(r"\.(\d+)\.", f".{layer_name}.")
    if not numbers:
        raise ValueError(f"cannot tell the layer index of {layer_name!r}")
    return int(numbers[0])
