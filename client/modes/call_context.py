"""What a reuse policy may use during one call: `CallContext`, and `StoreContext` with a store.

Owns the two context types only; the engine builds one per call and nothing changes
it after. What a policy plans goes back through `PlannedCall`, not through the context.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvsplice.client.execute.call_executor import CallExecutor
from kvsplice.client.execute.call_timings import CallTimings
from kvsplice.client.store.local_tier import LocalTier
from kvsplice.client.store.segment_io import SegmentStore
from kvsplice.client.store.segment_puts import SegmentSink
from kvsplice.kvmath.rope import RopeSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallContext:
    """What a policy may use during one call (built by the engine per call, never changed).

    `executor` runs plans of both kinds (its `layerwise` loop for approximate
    ones); `rope` moves keys; `decode_dtype`: what fetched payloads decode to
    (fp32: shift first, cast once). An engine without a store hands its policies
    this; with one, a `StoreContext`. What a policy planned comes back to it as
    its `PlannedCall`; what the run produced, as the `ExecutionState` `after_call` gets.
    """

    fingerprint: str
    executor: CallExecutor
    rope: RopeSpec
    decode_dtype: torch.dtype
    timings: CallTimings
    decode_text: Callable[[Sequence[int]], str]
    encode_text: Callable[[str], tuple[int, ...]]
    quant: str


@dataclass(frozen=True)
class StoreContext(CallContext):
    """A call's context on an engine with a store; code that looks segments up or puts
    them takes this one (without a store there is nothing to find and nowhere to put).

    `local`: the worker's decoded tier (0 bytes: none). `writer`: where `record_call`
    hands the call's segments (the engine's `SegmentWriter` thread, or `DirectPuts`).
    """

    store: SegmentStore
    local: LocalTier
    writer: SegmentSink

    @classmethod
    def of(
        cls, ctx: CallContext, store: SegmentStore, local: LocalTier, writer: SegmentSink
    ) -> StoreContext:
        """`ctx` (a plain `CallContext`) with the engine's store, tier and writer."""
        return cls(**vars(ctx), store=store, local=local, writer=writer)
