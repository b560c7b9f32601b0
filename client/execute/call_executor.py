"""The one executor a call sees: a plan of either kind in, an `ExecutionState` out.

The fast path: a `ReusePlan` (each reused span reads every layer from the store,
the rest is computed) splices the reused K/V into an HF cache and runs the model
over the computed spans (`SpanExecutor`). The general path: a `LayerwiseCall`
(spans joining at other layers, subset rules, corrected K/V) runs through the
model's decoder layers (`LayerwiseExecutor`); its K/V continue in an HF cache as
the call's `view`, and its result comes back in the state, not beside it.
It never decides what to reuse.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from kvsplice.client.execute.call_timings import CallTimings, timed
from kvsplice.client.execute.layerwise_call import LayerwiseCall
from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.execute.reuse_plan import ReusePlan
from kvsplice.client.execute.span_executor import ExecutionState, GenerationConfig, SpanExecutor
from kvsplice.common.layout import KVLayout
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)


class CallExecutor:
    """Prefill, decode and read back K/V on one model (batch 1), whatever the plan's kind."""

    def __init__(self, model: PreTrainedModel, layout: KVLayout, rope: RopeSpec) -> None:
        self._model = model
        self.num_layers = layout.num_layers
        self.spans = SpanExecutor(model, layout, rope)

    @functools.cached_property
    def layerwise(self) -> LayerwiseExecutor:
        """The decoder-layer loop, built on first use (only approximate plans need it)."""
        return LayerwiseExecutor(self._model)

    def prefill(self, planned: ReusePlan | LayerwiseCall, timings: CallTimings) -> ExecutionState:
        """Run `planned` and pick the first token (`state.generated == [first]`)."""
        if isinstance(planned, ReusePlan):
            return self.spans.prefill(planned, timings)
        with timed(timings, "prefill_s"):
            result = planned.result or self.layerwise.run(planned.plan)
        view = planned.view(result)
        with timed(timings, "splice_s"):
            cache = result.kv.to_dynamic_cache()
        with timed(timings, "first_decode_s"):
            first = int(torch.argmax(result.logits_last))
        return ExecutionState(
            view, cache, result.logits_last, [first], view.num_tokens, layerwise=result
        )

    def generate(
        self, state: ExecutionState, config: GenerationConfig, timings: CallTimings
    ) -> None:
        self.spans.generate(state, config, timings)

    def read_kv(self, state: ExecutionState, start: int, end: int) -> SegmentKV:
        return self.spans.read_kv(state, start, end)

    def forward(self, token_ids: Sequence[int], start: int, cache: DynamicCache) -> torch.Tensor:
        return self.spans.forward(token_ids, start, cache)
