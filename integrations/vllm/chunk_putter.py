"""The background putter: encodes gathered chunks and puts them into the sidecar.

The forward pass only copies a chunk's blocks out (one copy, in the cache's layout) and
enqueues them; reordering them to token-major K/V, encoding, checksumming and the put
run on this thread. A full queue drops the chunk (counted,
logged once a while): a dropped save is a future miss, never a stall. Every chunk's
outcome (stored, or not) goes to `on_outcome`, so the scheduler counts a chunk as
stored only once the sidecar acknowledged it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvsplice.common.log_limits import RateLimitedLog
from kvsplice.common.segment import chained_meta
from kvsplice.integrations.vllm.block_layout import BlockLayout
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.integrations.vllm.transfer_specs import SaveSpec
from kvsplice.kvmath.payload import encode_payload
from kvsplice.kvmath.segment_kv import SegmentKV
from kvsplice.storeclient.put_queue import PutQueue

logger = logging.getLogger(__name__)
WARN_INTERVAL_S = 30.0


@dataclass(frozen=True)
class GatheredChunk:
    """A chunk's blocks as copied out of the engine's cache in its step: one copy per layer,
    in the cache's own layout; reordered to token-major K/V on the putter's thread."""

    spec: SaveSpec
    blocks: tuple[torch.Tensor, ...]  # per layer [n, H_kv, N, 2D] on the CPU
    layout: BlockLayout

    def kv(self) -> SegmentKV:
        """keys/values [L, H_kv, T, D]."""
        first = self.blocks[0]
        shape = (len(self.blocks), self.layout.num_kv_heads, len(first) * self.layout.block_size,
                 self.layout.head_dim)  # fmt: skip
        keys, values = torch.empty(shape, dtype=first.dtype), torch.empty(shape, dtype=first.dtype)
        for layer, blocks in enumerate(self.blocks):
            self.layout.tokens_into(blocks, keys[layer], values[layer])
        return SegmentKV(keys, values, start_position=self.spec.start)


@dataclass
class PutterCounters:
    num_put: int = 0
    num_failed: int = 0
    num_dropped: int = 0


OutcomeFn = Callable[[SaveSpec, bool], None]


class ChunkPutter:
    def __init__(
        self,
        clients: StoreClients,
        quant: str,
        max_pending: int,
        on_outcome: OutcomeFn,
        faults: FaultLog | None = None,
    ) -> None:
        self.clients = clients
        self.faults = faults or FaultLog()
        self.quant = quant
        self.on_outcome = on_outcome
        self.counters = PutterCounters()
        self._warnings = RateLimitedLog(logger, WARN_INTERVAL_S)
        self._puts = PutQueue(self._handle, max_pending, name="kvsplice-putter")

    def submit(self, chunk: GatheredChunk) -> bool:
        if self._puts.offer(chunk):
            return True
        self.counters.num_dropped += 1
        self.on_outcome(chunk.spec, False)
        self._warn(
            "the sidecar is not keeping up: dropped a chunk (%d so far)",
            self.counters.num_dropped,
        )
        return False

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every submitted chunk was put or failed; False on timeout."""
        return self._puts.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self._puts.close(timeout_s)

    def _handle(self, chunk: GatheredChunk) -> None:
        stored = False
        try:
            stored = self._put(chunk)
        except Exception as error:  # a refusal (a reader's token) or a bug: not stored
            self.counters.num_failed += 1
            logger.debug("storing a chunk failed", exc_info=True)
            self.faults.record(f"put refused ({type(error).__name__})", error)
        finally:
            self.on_outcome(chunk.spec, stored)

    def _put(self, chunk: GatheredChunk) -> bool:
        spec = chunk.spec
        kv = chunk.kv()
        meta = chained_meta(
            spec.namespace, spec.root, spec.parent_key, spec.token_ids, spec.start,
            kv.num_layers, created_at_s=time.time(), kind="prompt", exact=spec.exact,
        )  # fmt: skip
        payload = encode_payload(kv, model_fingerprint=spec.root, quant=self.quant)
        if self.clients.for_namespace(spec.namespace).put_segment(meta, payload, spec.session_id):
            self.counters.num_put += 1
            return True
        self.counters.num_failed += 1
        self._warn("the sidecar is unreachable: %d chunks not stored", self.counters.num_failed)
        return False

    def _warn(self, message: str, count: int) -> None:
        if self._warnings.due("putter") is not None:  # one line per interval, either kind
            logger.warning(message, count)
