"""The one executor: a `CallPlan` in, an `ExecutionState` out; then greedy decode and K/V reads.

Two paths, chosen by the plan alone. The splice path, when every reused span
reads all its layers from the store and the computed tokens are one run at the
end (an exact prefix, or everything reused but the tail): reused K/V (keys
Δ-shifted) are written into a preallocated HF cache (`SpareSlotsCache`, its buffers
the executor's pool reuses across calls) and the model runs once over the tail,
extending that cache in place.
Every other plan (computed tokens in several places, spans joining at other
layers, subset rules, captured states) runs through the decoder-layer loop
(`LayerwiseExecutor`), all its computed tokens in one pass per layer, whose K/V
continue in an HF cache. (The splice path could run several computed runs, one
model forward each, but that costs a forward's fixed overhead per run: a halo
call with ten 4-token halos ran at 1.1× dense that way and 3.1× in the loop.)
Either way what the run reused comes back as the state's `ReuseMap`, and reused K/V
reach the cache through `kvmath.fused_decode.decode_into`: a stored int8 payload is
dequantized, shifted and written in one pass. It never decides what to reuse.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from kvsplice.client.execute.execution import (
    CallTimings,
    ExecutionState,
    GenerationConfig,
    TokenPicker,
    reuse_map,
    timed,
)
from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor, LayerwiseResult
from kvsplice.client.execute.plan import CallPlan, PlanSpan
from kvsplice.client.model.hf_cache import cache_kwarg, read_layers
from kvsplice.client.model.kv_buffer_pool import KVBufferPool
from kvsplice.client.model.models import fp32_head
from kvsplice.client.model.spare_slots_cache import SpareSlotsCache
from kvsplice.common.errors import LayoutMismatch
from kvsplice.common.layout import KVLayout
from kvsplice.kvmath.fused_decode import PinnedStaging, decode_into
from kvsplice.kvmath.payload import KVSource
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)


class CallExecutor:
    """Prefill, decode and read back K/V on one model (batch 1), whatever the plan."""

    def __init__(self, model: PreTrainedModel, layout: KVLayout, rope: RopeSpec) -> None:
        self._model = model
        self._layout = layout
        self._rope = rope
        self._staging = PinnedStaging()  # carries int8 payload bytes to a GPU model
        self._buffers = KVBufferPool()  # the splice path's caches, reused across calls
        self._head = fp32_head(model)  # every logit read in float32 (`models.fp32_head`)
        self.num_layers = layout.num_layers

    @property
    def device(self) -> torch.device:
        """Where the model is, and so the K/V a call runs on."""
        return self._model.device

    @functools.cached_property
    def layerwise(self) -> LayerwiseExecutor:
        """The decoder-layer loop, built on first use (only approximate plans need it)."""
        return LayerwiseExecutor(self._model, self._rope)

    def prefill(
        self, plan: CallPlan, timings: CallTimings, ran: LayerwiseResult | None = None
    ) -> ExecutionState:
        """Run `plan` and pick the first token (`state.generated == [first]`).

        `ran`: `plan`'s run when the caller already made it (to test it); the state
        continues from it and nothing runs again.
        """
        if ran is None and takes_splice_path(plan):
            return self.splice_prefill(plan, timings)
        with timed(timings, "prefill_s"):
            result = self.layerwise.run(plan) if ran is None else ran
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
        """Continue from `state.generated` (the first token) until a stop.

        Greedy, or sampled under `config` (then the prefill's greedy first token is
        drawn again from `state.logits_first`). With `config.forced_ids` the answer
        becomes those tokens and nothing runs here (`read_kv` feeds them when read).
        """
        if config.forced_ids:
            state.generated[:] = list(config.forced_ids)
            return
        picker = TokenPicker(config)
        if picker.samples and len(state.generated) == 1:
            state.generated[0] = picker.pick(state.logits_first)
        with timed(timings, "decode_tokens_s"):
            while not _done(state.generated, config):
                logits = self.forward(state.generated[-1:], state.num_cached, state.cache)
                state.num_cached += 1
                state.generated.append(picker.pick(logits))

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
        decoder = self._model.get_decoder()
        with torch.inference_mode():
            out = decoder(
                input_ids=ids, position_ids=positions, **cache_kwarg(decoder, cache), use_cache=True,
            )  # fmt: skip
            return self._head(out.last_hidden_state[0, -1])

    def splice_prefill(self, plan: CallPlan, timings: CallTimings) -> ExecutionState:
        """Lay every span of `plan` (`splices_only`) into a fresh cache and pick the first token.

        Adjacent computed spans run as one forward pass; adjacent reused spans are
        joined and appended in one copy per layer.
        """
        if not splices_only(plan):
            raise ValueError("the plan needs the decoder-layer loop, not the splice path")
        cache = self._fresh_cache(plan.num_tokens)
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
        self, cache: SpareSlotsCache, spans: Sequence[PlanSpan], timings: CallTimings
    ) -> None:
        """Append consecutive reused spans, each moved by its own Δ, to every layer of `cache`.

        Each span is written once (`decode_into`) into the next slots of the cache's own
        [L, 1, H_kv, T_cap, D] K and V buffers: no buffer of its own, no copy into the cache
        (which never aliases a tier's tensors: the local tier hands out what it holds).
        """
        for span in spans:
            assert span.kv is not None
            check_segment_layout(span.kv, self._layout)

        def write(keys: torch.Tensor, values: torch.Tensor) -> None:  # [L, H_kv, T, D]
            target = 0
            for span in spans:
                assert span.kv is not None
                rows = slice(target, target + span.num_tokens)
                decode_into(
                    span.kv, self._rope, span.delta, keys[:, :, rows], values[:, :, rows],
                    self._staging,
                )  # fmt: skip
                target += span.num_tokens

        with timed(timings, "splice_s"):
            cache.append_in_place(sum(span.num_tokens for span in spans), write)

    def _fresh_cache(self, num_tokens: int) -> SpareSlotsCache:
        """An empty cache for a call of `num_tokens` (and spare slots), in buffers from the
        executor's pool: a former call's, once nothing holds a view of them."""
        layout, model = self._layout, self._model
        keys, values = self._buffers.acquire(
            layout.num_layers, layout.num_kv_heads, num_tokens, layout.head_dim, model.dtype,
            model.device,
        )  # fmt: skip
        return SpareSlotsCache(keys, values)


def takes_splice_path(plan: CallPlan) -> bool:
    """Whether `prefill` splices `plan`: it can (`splices_only`) and its computed tokens
    are one run, so the model runs once."""
    return splices_only(plan) and sum(g[0].computed for g in _group_runs(plan.spans)) == 1


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


def check_segment_layout(segment: KVSource, layout: KVLayout) -> None:
    """Raise `LayoutMismatch` unless the segment is full-depth with the model's geometry."""
    num_layers, num_heads, _, head_dim = segment.kv_shape
    if segment.layer_start != 0 or num_layers != layout.num_layers:
        raise LayoutMismatch(
            f"segment layers [{segment.layer_start}, {segment.layer_start + num_layers}) "
            f"!= model layers [0, {layout.num_layers})"
        )
    if (num_heads, head_dim) != (layout.num_kv_heads, layout.head_dim):
        raise LayoutMismatch(
            f"segment heads/head_dim ({num_heads}, {head_dim}) "
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
