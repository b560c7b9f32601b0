"""Running a `ReusePlan` on an HF model: span by span into one v5 cache, then greedy decode.

Owns the prefill of a plan (reused spans appended with their keys Δ-shifted,
computed spans run with explicit positions on top of the cache), greedy
generation, and reading K/V ranges back out of the cache for storing. It is
mode-agnostic: it never looks anything up and never decides what to reuse.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from kvsplice.client.execute.call_timings import CallTimings, timed
from kvsplice.client.execute.layerwise_result import LayerwiseResult
from kvsplice.client.execute.reuse_plan import Compute, PlannedSpan, Reuse, ReusePlan
from kvsplice.client.execute.splice import check_segment_layout
from kvsplice.client.model.hf_cache import append_layer_runs, full_length_cache, read_layers
from kvsplice.common.layout import KVLayout
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationConfig:
    """Greedy decoding limits: stop after `max_new_tokens` or at a stop token.

    `ignore_stop` generates exactly `max_new_tokens` (fixed-shape benchmarks).
    `forced_ids` (teacher forcing): the answer is these tokens, as if generated;
    nothing is decoded, and storing reads their K/V as it would a generated answer's.
    """

    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_stop: bool = False
    forced_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} must be >= 1")
        if self.forced_ids and len(self.forced_ids) > self.max_new_tokens:
            raise ValueError(
                f"{len(self.forced_ids)} forced tokens exceed max_new_tokens {self.max_new_tokens}"
            )


@dataclass
class ExecutionState:
    """The cache after a plan's prefill and what generation has added since.

    `cache` holds K/V for positions [0, num_cached); `generated` are the greedy
    tokens so far (the newest one is not in the cache until it is fed).
    `layerwise`: the decoder-layer run that built the cache (None: the span path),
    with its captured states; `plan` is then that run's view.
    """

    plan: ReusePlan
    cache: DynamicCache
    logits_first: torch.Tensor  # [V] float32, the last prompt token's logits
    generated: list[int] = field(default_factory=list)
    num_cached: int = 0
    layerwise: LayerwiseResult | None = None

    @property
    def prompt_len(self) -> int:
        return self.plan.num_tokens


class SpanExecutor:
    """Executes plans on one model (batch 1). Construct from a `LoadedModel`'s parts."""

    def __init__(self, model: PreTrainedModel, layout: KVLayout, rope: RopeSpec) -> None:
        self._model = model
        self._layout = layout
        self._rope = rope

    def prefill(self, plan: ReusePlan, timings: CallTimings) -> ExecutionState:
        """Lay every span of `plan` into a fresh cache and pick the first token.

        Adjacent computed spans run as one forward pass; adjacent reused spans are
        joined and appended in one copy per layer. On return
        `state.generated == [first token]`.
        """
        cache = full_length_cache()
        logits: torch.Tensor | None = None
        for group in _group_runs(plan.spans):
            action = group[0].action
            if isinstance(action, Reuse):
                self._append_reused(cache, group, timings)
            elif isinstance(action, Compute):
                ids = plan.token_ids[group[0].start : group[-1].end]
                with timed(timings, "prefill_s"):
                    logits = self.forward(ids, group[0].start, cache)
            else:  # a newer action type needs its own runner (e.g. a layerwise executor)
                raise NotImplementedError(f"SpanExecutor cannot run {type(action).__name__}")
        assert logits is not None  # ReusePlan guarantees a computed last span
        with timed(timings, "first_decode_s"):
            first = int(torch.argmax(logits))
        return ExecutionState(plan, cache, logits, [first], plan.num_tokens)

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
            while not self._done(state.generated, config):
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

    def _append_reused(
        self, cache: DynamicCache, spans: Sequence[PlannedSpan], timings: CallTimings
    ) -> None:
        """Append consecutive reused spans, each moved by its own Δ, in one copy per layer."""
        dtype, device = self._model.dtype, self._model.device
        keys, values = [], []
        for span in spans:
            assert isinstance(span.action, Reuse)
            segment = span.action.segment
            check_segment_layout(segment, self._layout)
            # keys: [L, H_kv, T, D]; Δ = new − old position. Shifted on the model's device,
            # in fp32 at least (RopeSpec), before the cast; Δ = 0 is no rotation at all.
            k = segment.keys.to(device)
            if span.delta != 0:
                with timed(timings, "shift_s"):
                    k = self._rope.shift_layers(k, span.delta, layer_start=segment.layer_start)
            keys.append(k.to(dtype))
            values.append(segment.values.to(device, dtype))
        with timed(timings, "splice_s"):
            # NOTE: one concatenation per layer into fresh tensors, so the cache never
            # aliases a tier's tensors (the local tier hands out what it holds).
            append_layer_runs(cache, keys, values)

    @staticmethod
    def _done(generated: list[int], config: GenerationConfig) -> bool:
        if len(generated) >= config.max_new_tokens:
            return True
        return not config.ignore_stop and generated[-1] in config.stop_token_ids


def _group_runs(spans: Sequence[PlannedSpan]) -> list[list[PlannedSpan]]:
    """Consecutive spans of the same action type together (one forward, or one splice)."""
    groups: list[list[PlannedSpan]] = []
    for span in spans:
        if groups and type(groups[-1][0].action) is type(span.action):
            groups[-1].append(span)
        else:
            groups.append([span])
    return groups


def content_tokens(generated: Sequence[int], config: GenerationConfig) -> tuple[int, ...]:
    """The generated tokens without a trailing stop token (what downstream agents see)."""
    if generated and not config.ignore_stop and generated[-1] in config.stop_token_ids:
        return tuple(generated[:-1])
    return tuple(generated)
