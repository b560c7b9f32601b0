"""Capture: one forward pass -> `SegmentKV`s for chosen token spans.

Keys are captured post-RoPE at the absolute positions of the pass, so a span
`[start, end)` becomes a segment with `start_position = position_offset + start`.
Boundary states are the residual stream entering chosen decoder layers. It does
not encode, store or splice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from kvsplice.client.model.hf_cache import cache_kwarg, full_length_cache, read_layers
from kvsplice.client.model.models import fp32_head
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

Span = tuple[int, int]


@dataclass(frozen=True)
class CaptureResult:
    """Segments in the order of the requested spans, and the pass's last-token logits [V]."""

    segments: list[SegmentKV]
    logits_last: torch.Tensor


def capture_segments(
    model: PreTrainedModel,
    input_ids: torch.Tensor | Sequence[int],
    spans: Sequence[Span],
    *,
    boundary_layers: Sequence[int] = (),
    position_offset: int = 0,
) -> CaptureResult:
    """Run `input_ids` once (positions `position_offset + arange(T)`) and cut `spans` out.

    input_ids: [T] or [1, T]. Each span is `[start, end)` with 0 <= start < end <= T.
    boundary_layers: decoder layer indices l in [0, L]; the state of token t entering
    layer l (l == L: the final norm's input, i.e. the last layer's output) is
    stored as `segment.boundary_states[l]` [T_span, hidden].
    """
    ids = _as_batch(input_ids, model)
    num_tokens = ids.shape[1]
    _check_spans(spans, num_tokens)
    cache = full_length_cache()
    positions = torch.arange(num_tokens, device=ids.device).unsqueeze(0) + position_offset
    decoder = model.get_decoder()
    with torch.inference_mode(), _record_boundaries(model, boundary_layers) as states:
        out = decoder(
            input_ids=ids, position_ids=positions, **cache_kwarg(decoder, cache), use_cache=True
        )
        logits_last = fp32_head(model)(out.last_hidden_state[0, -1])
    segments = [_cut(cache, states, span, position_offset) for span in spans]
    return CaptureResult(segments=segments, logits_last=logits_last)


def _cut(
    cache: DynamicCache, states: dict[int, torch.Tensor], span: Span, position_offset: int
) -> SegmentKV:
    start, end = span
    keys, values = read_layers(cache, start, end)
    boundaries = {layer: state[start:end].clone() for layer, state in states.items()}
    return SegmentKV(
        keys, values, start_position=position_offset + start, boundary_states=boundaries
    )


@contextmanager
def _record_boundaries(
    model: PreTrainedModel, layers: Sequence[int]
) -> Iterator[dict[int, torch.Tensor]]:
    """Forward pre-hooks that record the hidden state entering each chosen layer.

    NOTE: hooks rather than `output_hidden_states`, because in transformers v5 the
    last element of `hidden_states` is the *normed* output (after `model.norm`),
    while a boundary at l == L must be the residual stream before it.
    """
    decoder = model.get_decoder()
    modules = [*decoder.layers, decoder.norm]
    states: dict[int, torch.Tensor] = {}
    handles = []
    for layer in sorted(set(layers)):
        if not 0 <= layer < len(modules):
            raise ValueError(f"boundary layer {layer} outside [0, {len(modules) - 1}]")
        handles.append(
            modules[layer].register_forward_pre_hook(_recorder(states, layer), with_kwargs=True)
        )
    try:
        yield states
    finally:
        for handle in handles:
            handle.remove()


def _recorder(states: dict[int, torch.Tensor], layer: int) -> Callable[..., None]:
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        states[layer] = hidden[0].detach()  # [T, hidden], batch 1

    return hook


def _as_batch(input_ids: torch.Tensor | Sequence[int], model: PreTrainedModel) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=model.device)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [T] or [1, T] with T > 0, got {tuple(ids.shape)}")
    return ids


def _check_spans(spans: Sequence[Span], num_tokens: int) -> None:
    for start, end in spans:
        if not 0 <= start < end <= num_tokens:
            raise ValueError(f"span [{start}, {end}) outside [0, {num_tokens}) or empty")
