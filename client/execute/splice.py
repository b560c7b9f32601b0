"""Splice: stored segments -> an HF cache for a prompt prefix, then prefill and decode.

Segments are laid contiguously from position 0; a segment captured elsewhere is
moved by Δ = target − start_position (`RopeSpec.shift_layers`, or fused with the
dequantize for stored int8 segments; Δ = 0 is a bit-exact copy). It does not fetch, decode payloads or decide whether reuse is safe.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from kvsplice.client.model.hf_cache import install_layers, model_cache
from kvsplice.common.errors import InvalidRequest, LayoutMismatch
from kvsplice.common.layout import KVLayout
from kvsplice.kvmath.fused_decode import PinnedStaging, decode_into
from kvsplice.kvmath.payload import StoredKV
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)


# A segment to splice: decoded, or still in stored form (the fused path).
SpliceSource = SegmentKV | StoredKV


@dataclass(frozen=True)
class SplicedSegment:
    """A segment to splice and the token ids it encodes (checked against the prompt)."""

    kv: SpliceSource
    token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != self.kv.num_tokens:
            raise LayoutMismatch(
                f"{len(self.token_ids)} token ids for a segment of {self.kv.num_tokens} tokens"
            )


@dataclass
class PrefillResult:
    """Last-token logits [V] (fp32) and the cache after the whole prompt.

    The cache is consumed by decoding (it grows in place); `num_reused_tokens`
    counts prompt tokens taken from segments instead of computed.
    """

    logits_last: torch.Tensor
    cache: DynamicCache
    num_reused_tokens: int


def build_cache(
    model: PreTrainedModel,
    segments: Sequence[SpliceSource],
    layout: KVLayout,
    rope: RopeSpec,
    staging: PinnedStaging | None = None,
) -> DynamicCache:
    """A model cache holding `segments` back to back from position 0.

    Segment i lands at target = sum of the lengths before it; its keys are
    shifted by Δ = target − start_position on the way. Every segment must cover all
    layers with the model's heads and head_dim (else `LayoutMismatch`). Each is
    written once into one preallocated [L, 1, H_kv, T, D] buffer per K and V, which
    the cache's layers then view: stored (`StoredKV`) int8 segments dequantize, shift
    and land in one fused pass (`kvmath.fused_decode`); decoded ones are shifted and
    copied in. `staging` (pinned) carries int8 bytes to a GPU model.
    """
    cache = model_cache(model)
    if not segments:
        return cache
    for segment in segments:
        check_segment_layout(segment, layout)
    total = sum(segment.num_tokens for segment in segments)
    shape = (layout.num_layers, 1, layout.num_kv_heads, total, layout.head_dim)
    keys = torch.empty(shape, dtype=model.dtype, device=model.device)
    values = torch.empty(shape, dtype=model.dtype, device=model.device)
    target = 0
    for segment in segments:
        rows = slice(target, target + segment.num_tokens)
        delta = target - segment.start_position
        keys_out, values_out = keys[:, 0, :, rows], values[:, 0, :, rows]
        if isinstance(segment, StoredKV):
            decode_into(segment, rope, delta, keys_out, values_out, staging)
        else:
            keys_out.copy_(_keys_at(segment, delta, rope, model.device))
            values_out.copy_(segment.values)
        target += segment.num_tokens
    install_layers(cache, keys, values)
    return cache


def _keys_at(segment: SegmentKV, delta: int, rope: RopeSpec, device: torch.device) -> torch.Tensor:
    """Keys [L, H_kv, T, D] on `device`, rotated by Δ (a positive Δ moves later)."""
    keys = segment.keys.to(device)
    if delta == 0:
        return keys
    return rope.shift_layers(keys, delta, layer_start=segment.layer_start)


def check_segment_layout(segment: SpliceSource, layout: KVLayout) -> None:
    """Raise `LayoutMismatch` unless the segment is full-depth with the model's geometry."""
    shape = segment.kv_shape if isinstance(segment, StoredKV) else segment.keys.shape
    _, num_heads, _, head_dim = shape
    if segment.layer_start != 0 or segment.num_layers != layout.num_layers:
        raise LayoutMismatch(
            f"segment layers [{segment.layer_start}, {segment.layer_end}) "
            f"!= model layers [0, {layout.num_layers})"
        )
    if (num_heads, head_dim) != (layout.num_kv_heads, layout.head_dim):
        raise LayoutMismatch(
            f"segment heads/head_dim ({num_heads}, {head_dim}) "
            f"!= model ({layout.num_kv_heads}, {layout.head_dim})"
        )


def prefill_with_segments(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    segments: Sequence[SplicedSegment],
    layout: KVLayout,
    rope: RopeSpec,
) -> PrefillResult:
    """Splice `segments` over `prompt_ids[:P]`, then prefill `prompt_ids[P:]` (P < len).

    The segments must tile `[0, P)` in order with exactly the prompt's tokens
    (`InvalidRequest` otherwise); with no segments this is a dense prefill.
    """
    num_reused = _check_tiling(prompt_ids, segments)
    cache = build_cache(model, [s.kv for s in segments], layout, rope)
    logits = _forward_tokens(model, prompt_ids[num_reused:], num_reused, cache)
    return PrefillResult(logits_last=logits, cache=cache, num_reused_tokens=num_reused)


def dense_prefill(model: PreTrainedModel, prompt_ids: Sequence[int]) -> PrefillResult:
    """The reference: the whole prompt through the model into a fresh model cache."""
    cache = model_cache(model)
    logits = _forward_tokens(model, prompt_ids, 0, cache)
    return PrefillResult(logits_last=logits, cache=cache, num_reused_tokens=0)


def _check_tiling(prompt_ids: Sequence[int], segments: Sequence[SplicedSegment]) -> int:
    offset = 0
    for index, segment in enumerate(segments):
        expected = tuple(int(t) for t in prompt_ids[offset : offset + len(segment.token_ids)])
        if segment.token_ids != expected:
            raise InvalidRequest(
                f"segment {index} tokens differ from prompt tokens at [{offset}, "
                f"{offset + len(segment.token_ids)})"
            )
        offset += len(segment.token_ids)
    if offset >= len(prompt_ids):
        raise InvalidRequest(
            f"segments cover {offset} of {len(prompt_ids)} prompt tokens; "
            "at least one token must be prefilled"
        )
    return offset


def _forward_tokens(
    model: PreTrainedModel, token_ids: Sequence[int], start: int, cache: DynamicCache
) -> torch.Tensor:
    """Run `token_ids` at positions `start ..` on top of `cache`; last-token logits [V]."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=model.device).unsqueeze(0)
    positions = torch.arange(start, start + ids.shape[1], device=model.device).unsqueeze(0)
    with torch.inference_mode():
        out = model(
            input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        )  # fmt: skip
    return out.logits[0, -1].float()


def greedy_generate(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    prefill: PrefillResult | None = None,
    eos_token_id: int | None = None,
) -> list[int]:
    """Greedy continuation of `prompt_ids` from `prefill` (dense prefill if None).

    Consumes `prefill.cache`. Stops after `max_new_tokens` or at `eos_token_id`
    (included in the output).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    state = prefill if prefill is not None else dense_prefill(model, prompt_ids)
    position, logits = len(prompt_ids), state.logits_last
    generated: list[int] = []
    while True:
        token = int(torch.argmax(logits))
        generated.append(token)
        if len(generated) == max_new_tokens or token == eos_token_id:
            return generated
        logits = _forward_tokens(model, [token], position, state.cache)
        position += 1
