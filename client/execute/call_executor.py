"""The one executor: a `CallPlan` in, an `ExecutionState` out; then greedy decode and K/V reads.

Two paths, chosen by the plan alone. The splice path, when every reused span
reads all its layers from the store and everything else is computed from
embeddings: reused K/V (keys Δ-shifted) are appended to an HF cache and the
model runs over the computed spans. Every other plan (spans joining at other
layers, subset rules, captured states) runs through the decoder-layer loop
(`LayerwiseExecutor`), whose K/V continue in an HF cache. Either way what the
run reused comes back as the state's `ReuseMap`. It never decides what to reuse.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from kvsplice.client.execute.call_timings import CallTimings, timed
from kvsplice.client.execute.execution import ExecutionState, GenerationConfig
from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.execute.layerwise_result import PrefilledPlan
from kvsplice.client.execute.plan import CallPlan, PlanSpan
from kvsplice.client.execute.reuse_map import reuse_map
from kvsplice.client.model.hf_cache import append_layer_runs, full_length_cache, read_layers
from kvsplice.common.errors import LayoutMismatch
from kvsplice.common.layout import KVLayout
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)


class CallExecutor:
    """Prefill, decode and read back K/V on one model (batch 1), whatever the plan."""

    def __init__(self, model: PreTrainedModel, layout: KVLayout, rope: RopeSpec) -> None:
        self._model = model
        self._layout = layout
        self._rope = rope
        self.num_layers = layout.num_layers

    @functools.cached_property
    def layerwise(self) -> LayerwiseExecutor:
        """The decoder-layer loop, built on first use (only approximate plans need it)."""
        return LayerwiseExecutor(self._model, self._rope)

    def prefill(self, planned: CallPlan | PrefilledPlan, timings: CallTimings) -> ExecutionState:
        """Run `planned` and pick the first token (`state.generated == [first]`)."""
        if isinstance(planned, CallPlan) and splices_only(planned):
            return self._splice_prefill(planned, timings)
        plan = planned.plan if isinstance(planned, PrefilledPlan) else planned
        with timed(timings, "prefill_s"):
            result = (
                planned.result if isinstance(planned, PrefilledPlan) else self.layerwise.run(plan)
            )
        reuse = reuse_map(plan, self.num_layers, result.kept_slots)
        with timed(timings, "splice_s"):
            cache = result.kv.to_dynamic_cache()
        with timed(timings, "first_decode_s"):
            first = int(torch.argmax(result.logits_last))
        return ExecutionState(
            reuse, cache, result.logits_last, [first], plan.num_tokens, layerwise=result
        )

    def generate(
        self, state: ExecutionState, config: GenerationConfig, timings: CallTimings
    ) -> None:
        """Continue greedily from `state.generated` (the first token) until a stop.

        With `config.forced_ids` the answer becomes those tokens and nothing runs here
        (`read_kv` feeds them when their K/V is read).
        """
        if config.forced_ids:
            state.generated[:] = list(config.forced_ids)
            return
        with timed(timings, "decode_tokens_s"):
            while not _done(state.generated, config):
                logits = self.forward(state.generated[-1:], state.num_cached, state.cache)
                state.num_cached += 1
                state.generated.append(int(torch.argmax(logits)))

    def read_kv(self, state: ExecutionState, start: int, end: int) -> SegmentKV:
        """K/V of positions [start, end) of prompt + generated tokens, as captured.

        Feeds generated tokens not yet in the cache first (one forward, after TTFT).
        """
        if end > state.num_cached:
            pending = state.generated[state.num_cached - state.prompt_len : end - state.prompt_len]
            self.forward(pending, state.num_cached, state.cache)
            state.num_cached += len(pending)
        keys, values = read_layers(state.cache, start, end)
        return SegmentKV(keys, values, start_position=start)

    def forward(self, token_ids: Sequence[int], start: int, cache: DynamicCache) -> torch.Tensor:
        """Run `token_ids` at positions `start ..` on top of `cache`; last-token logits [V] fp32."""
        device = self._model.device
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=device).unsqueeze(0)
        positions = torch.arange(start, start + ids.shape[1], device=device).unsqueeze(0)
        with torch.inference_mode():
            out = self._model(
                input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                logits_to_keep=1,
            )  # fmt: skip
        return out.logits[0, -1].float()

    def _splice_prefill(self, plan: CallPlan, timings: CallTimings) -> ExecutionState:
        """Lay every span of `plan` into a fresh cache and pick the first token.

        Adjacent computed spans run as one forward pass; adjacent reused spans are
        joined and appended in one copy per layer.
        """
        cache = full_length_cache()
        logits: torch.Tensor | None = None
        for group in _group_runs(plan.spans):
            if group[0].computed:
                ids = plan.token_ids[group[0].start : group[-1].end]
                with timed(timings, "prefill_s"):
                    logits = self.forward(ids, group[0].start, cache)
            else:
                self._append_reused(cache, group, timings)
        assert logits is not None  # `splices_only` guarantees a computed last span
        with timed(timings, "first_decode_s"):
            first = int(torch.argmax(logits))
        reuse = reuse_map(plan, self.num_layers)
        return ExecutionState(reuse, cache, logits, [first], plan.num_tokens)

    def _append_reused(
        self, cache: DynamicCache, spans: Sequence[PlanSpan], timings: CallTimings
    ) -> None:
        """Append consecutive reused spans, each moved by its own Δ, in one copy per layer."""
        dtype, device = self._model.dtype, self._model.device
        keys, values = [], []
        for span in spans:
            assert span.keys is not None and span.values is not None
            _check_layout(span, self._layout)
            # keys: [L, H_kv, T, D]; Δ = new − old position. Shifted on the model's device,
            # in fp32 at least (RopeSpec), before the cast; Δ = 0 is no rotation at all.
            k = span.keys.to(device)
            if span.delta != 0:
                with timed(timings, "shift_s"):
                    k = self._rope.shift_layers(k, span.delta, layer_start=0)
            keys.append(k.to(dtype))
            values.append(span.values.to(device, dtype))
        with timed(timings, "splice_s"):
            # NOTE: one concatenation per layer into fresh tensors, so the cache never
            # aliases a tier's tensors (the local tier hands out what it holds).
            append_layer_runs(cache, keys, values)


def splices_only(plan: CallPlan) -> bool:
    """Whether `plan` runs on the splice path: each span is computed from its embeddings
    through every layer or reads every layer it provides (the model's all, checked when
    spliced), nothing is captured or selected, and only the last token's logits are asked."""
    return (
        plan.position_offset == 0
        and not plan.subsets
        and not plan.capture_layers
        and plan.logits_slots == (plan.num_tokens - 1,)
        and plan.spans[-1].computed
        and all(s.computed or s.start_layer == s.num_kv_layers > 0 for s in plan.spans)
    )


def _check_layout(span: PlanSpan, layout: KVLayout) -> None:
    """Raise `LayoutMismatch` unless the span provides every layer with the model's geometry."""
    assert span.keys is not None
    num_layers, num_heads, _, head_dim = span.keys.shape
    if num_layers != layout.num_layers:
        raise LayoutMismatch(
            f"span {span.name!r} K/V layers [0, {num_layers}) != model layers [0, {layout.num_layers})"
        )
    if (num_heads, head_dim) != (layout.num_kv_heads, layout.head_dim):
        raise LayoutMismatch(
            f"span {span.name!r} heads/head_dim ({num_heads}, {head_dim}) "
            f"!= model ({layout.num_kv_heads}, {layout.head_dim})"
        )


def _group_runs(spans: Sequence[PlanSpan]) -> list[list[PlanSpan]]:
    """Consecutive spans of the same kind together (one forward, or one splice)."""
    groups: list[list[PlanSpan]] = []
    for span in spans:
        if groups and groups[-1][0].computed == span.computed:
            groups[-1].append(span)
        else:
            groups.append([span])
    return groups


def _done(generated: list[int], config: GenerationConfig) -> bool:
    if len(generated) >= config.max_new_tokens:
        return True
    return not config.ignore_stop and generated[-1] in config.stop_token_ids
