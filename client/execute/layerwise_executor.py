"""The layerwise executor: runs a `CallPlan` through the model's own decoder layers.

The general path of `CallExecutor`. Owns the layer loop: pre-fill reused K/V
(`kvmath.fused_decode.decode_into`: keys rotated by their span's Δ), let spans join at their start layer,
call each HF decoder layer on the active tokens with an explicit mask and a
slot-writing cache, apply subset rules, capture states, and compute logits; and
what a run returns (`LayerwiseResult`: logits, the filled K/V buffer, captured
hidden states). It never decides what to reuse and never re-implements attention.

Also owns the buffer the loop fills: `KVBuffer`, the full-length per-layer K/V of one
prompt written at token slots (positions `position_offset + slot`) and exported as a v5
`DynamicCache` or a `SegmentKV`; `SlotWriteCache`, what HF attention gets as
`past_key_values` (HF v5 attention only calls `update(key_states, value_states,
layer_idx)` and attends to what it returns, so it writes the computed tokens' K/V at
their slots and returns every slot of the layer: the model's own attention runs over
reused + computed K/V); and `PendingSelection`, which applies a `SubsetRule` at its
check layer (which tokens are worth recomputing is a policy's business).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from kvsplice.client.execute.active import ActiveTokens, TokenSlots
from kvsplice.client.execute.plan import CallPlan, SubsetRule, check_fits
from kvsplice.client.model.hf_cache import (
    append_layers,
    cache_kwarg,
    full_length_cache,
    model_cache,
)
from kvsplice.client.model.model_adapter import DecoderAdapter
from kvsplice.kvmath.fused_decode import decode_into
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import LayeredKV, SegmentKV

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class CapturedStates:
    """The residual stream entering one layer, for the tokens computed there.

    slots: ascending prompt slots; states: [len(slots), hidden].
    """

    slots: tuple[int, ...]
    states: torch.Tensor

    def span(self, start: int, end: int) -> torch.Tensor:
        """States of slots [start, end): [end - start, hidden]; ValueError if any was not computed."""
        try:
            first = self.slots.index(start)
        except ValueError:
            raise ValueError(f"slot {start} was not computed at this layer") from None
        if self.slots[first : first + end - start] != tuple(range(start, end)):
            raise ValueError(f"slots [{start}, {end}) were not all computed at this layer")
        return self.states[first : first + end - start]


@dataclass(frozen=True, eq=False)
class LayerwiseResult:
    """logits: [len(logits_slots), V] float32, rows in `logits_slots` (ascending) order.

    kv: every slot's K/V at every layer after the run (reused + computed).
    hidden_states: capture layer -> states of the tokens computed there.
    kept_slots: check layer -> slots still computed after its subset rule.
    num_computed: per layer, how many tokens ran through it (FLOPs accounting).
    """

    logits: torch.Tensor
    logits_slots: tuple[int, ...]
    kv: KVBuffer
    hidden_states: dict[int, CapturedStates]
    kept_slots: dict[int, tuple[int, ...]]
    num_computed: tuple[int, ...]

    @property
    def logits_last(self) -> torch.Tensor:
        """[V] float32: the highest requested slot's logits (the last prompt token by default)."""
        return self.logits[-1]


class LayerwiseExecutor:
    """Executes plans on one model, batch 1 (attn_implementation "eager" or "sdpa")."""

    def __init__(self, model: PreTrainedModel, rope: RopeSpec | None = None) -> None:
        self.adapter = DecoderAdapter.from_model(model)
        self.rope = rope or RopeSpec.from_hf_config(model.config.get_text_config(decoder=True))

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    def run(self, plan: CallPlan) -> LayerwiseResult:
        """Prefill `plan`; see `LayerwiseResult` for what comes back."""
        adapter = self.adapter
        check_fits(plan, adapter.num_layers, (adapter.num_kv_heads, adapter.head_dim))
        with torch.inference_mode():
            return _Run(adapter, plan, self.rope).execute()


class _Run:
    """One plan's execution state (kept off the executor so runs share nothing)."""

    def __init__(self, adapter: DecoderAdapter, plan: CallPlan, rope: RopeSpec) -> None:
        self.adapter = adapter
        self.plan = plan
        self.buffer = _prefilled_buffer(adapter, plan, rope)
        self.cache = SlotWriteCache(self.buffer)
        self.active = ActiveTokens(adapter, _initial_states(adapter, plan), plan.position_offset)
        self.captured: dict[int, CapturedStates] = {}
        self.kept: dict[int, tuple[int, ...]] = {}
        self.num_computed: list[int] = []

    def execute(self) -> LayerwiseResult:
        joins = _joins_by_layer(self.plan)
        for layer in range(self.adapter.num_layers):
            self.active.join(joins.get(layer, ()))
            self._capture(layer)
            self._run_layer(layer)
        self._capture(self.adapter.num_layers)
        return LayerwiseResult(
            logits=self._logits(),
            logits_slots=self.plan.logits_slots,
            kv=self.buffer,
            hidden_states=self.captured,
            kept_slots=self.kept,
            num_computed=tuple(self.num_computed),
        )

    def _run_layer(self, layer: int) -> None:
        active = self.active
        self.num_computed.append(len(active))
        if not len(active):
            return  # every token's K/V at this layer was provided
        self.cache.begin_layer(active.slots, self._pending_selection(layer))
        out = self.adapter.layers[layer](
            active.h, **cache_kwarg(self.adapter.layers[layer], self.cache), **active.layer_inputs(layer)
        )  # fmt: skip
        active.h = out[0] if isinstance(out, tuple) else out  # v4-style layers return tuples
        if self.cache.kept_local is not None:
            active.keep(self.cache.kept_local)
            self.kept[layer] = active.slots.ids

    def _pending_selection(self, layer: int) -> PendingSelection | None:
        rule = next((r for r in self.plan.subsets if r.check_layer == layer), None)
        if rule is None:
            return None
        ids = self.active.slots.ids
        droppable = _droppable_slots(self.plan, self.adapter.num_layers)
        local = [i for i, slot in enumerate(ids) if slot in droppable]
        device = self.active.slots.index.device
        return PendingSelection(
            rule=rule,
            candidate_local=torch.tensor(local, dtype=torch.long, device=device),
            candidate_slots=TokenSlots.of([ids[i] for i in local], device),
            num_active=len(ids),
        )

    def _capture(self, layer: int) -> None:
        if layer in self.plan.capture_layers:
            self.captured[layer] = CapturedStates(self.active.slots.ids, self.active.states())

    def _logits(self) -> torch.Tensor:
        """[len(logits_slots), V]: the last layer's output of the requested slots."""
        ids = self.active.slots.ids
        local = torch.tensor(
            [ids.index(s) for s in self.plan.logits_slots], device=self.active.h.device
        )
        return self.adapter.logits(self.active.h[0, local])


def _prefilled_buffer(adapter: DecoderAdapter, plan: CallPlan, rope: RopeSpec) -> KVBuffer:
    """[L, H_kv, T, D] zeros with every span's provided K/V written in at its slots
    (`decode_into`: keys rotated by the span's Δ on the way)."""
    shape = (adapter.num_layers, adapter.num_kv_heads, plan.num_tokens, adapter.head_dim)
    buffer = KVBuffer.zeros(shape, adapter.dtype, adapter.device, plan.position_offset)
    for span in plan.spans:
        if span.kv is not None:
            rows = (slice(0, span.num_kv_layers), slice(None), slice(span.start, span.end))
            decode_into(span.kv, rope, span.delta, buffer.keys[rows], buffer.values[rows])
    return buffer


def _initial_states(adapter: DecoderAdapter, plan: CallPlan) -> torch.Tensor:
    """[T, hidden]: each computed span's state entering its start layer (embeddings by default)."""
    states = torch.zeros(
        plan.num_tokens, adapter.hidden_size, dtype=adapter.dtype, device=adapter.device
    )  # fmt: skip
    for span in plan.spans:
        if span.start_layer >= adapter.num_layers:
            continue
        if span.hidden is not None:
            states[span.start : span.end] = span.hidden.to(adapter.device, adapter.dtype)
        else:
            ids = torch.tensor(plan.token_ids[span.start : span.end], dtype=torch.long)
            states[span.start : span.end] = adapter.embed(ids)
    return states


def _joins_by_layer(plan: CallPlan) -> dict[int, list[int]]:
    """start layer -> slots whose computation begins there."""
    joins: dict[int, list[int]] = {}
    for span in plan.spans:
        joins.setdefault(span.start_layer, []).extend(range(span.start, span.end))
    return joins


def _droppable_slots(plan: CallPlan, num_layers: int) -> set[int]:
    """Slots a subset rule may drop: their span provides K/V for every layer; not logits slots."""
    droppable = {
        slot
        for span in plan.spans
        if span.num_kv_layers == num_layers
        for slot in range(span.start, span.end)
    }
    return droppable - set(plan.logits_slots)


@dataclass(eq=False)
class KVBuffer(LayeredKV):
    """keys, values: [L, H_kv, T, D]; keys post-RoPE at positions `position_offset + slot`."""

    keys: torch.Tensor
    values: torch.Tensor
    position_offset: int = 0

    @classmethod
    def zeros(
        cls,
        shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        device: torch.device | str,
        position_offset: int = 0,
    ) -> KVBuffer:
        """An unfilled buffer of shape [L, H_kv, T, D]."""
        keys = torch.zeros(shape, dtype=dtype, device=device)
        return cls(keys, torch.zeros_like(keys), position_offset)

    def key_positions(self) -> torch.Tensor:
        """[T] long: the RoPE position of every slot."""
        return torch.arange(self.num_tokens, device=self.keys.device) + self.position_offset

    def write(
        self, layer: int, slots: TokenSlots, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """keys, values: [H_kv, N, D] for the N = len(slots) slots of `layer`."""
        slots.put(self.keys[layer], keys, dim=1)
        slots.put(self.values[layer], values, dim=1)

    def gather(self, layer: int, slots: TokenSlots) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `slots` at `layer`: ([H_kv, N, D], [H_kv, N, D])."""
        return slots.take(self.keys[layer], dim=1), slots.take(self.values[layer], dim=1)

    def layer_view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All slots of `layer` as attention reads them: ([1, H_kv, T, D], [1, H_kv, T, D]) views."""
        return self.keys[layer].unsqueeze(0), self.values[layer].unsqueeze(0)

    def read(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of slots [start, end), all layers: fresh [L, H_kv, end - start, D] tensors."""
        return self.keys[:, :, start:end].clone(), self.values[:, :, start:end].clone()

    def to_segment(self, start: int, end: int) -> SegmentKV:
        """Slots [start, end) as a segment captured at `position_offset + start`."""
        keys, values = self.read(start, end)
        return SegmentKV(keys, values, start_position=self.position_offset + start)

    def to_dynamic_cache(self, like_model: PreTrainedModel | None = None) -> DynamicCache:
        """A v5 `DynamicCache` holding every slot, for HF `generate` or a decode loop.

        Without `like_model` every layer keeps all tokens (sliding layers are
        masked from positions by the model); with it, the cache is built the way
        `generate` builds it, so sliding layers keep only their window.
        Decoding continues at position `position_offset + num_tokens`.
        """
        cache = full_length_cache() if like_model is None else model_cache(like_model)
        append_layers(cache, self.keys, self.values)
        return cache


@dataclass(frozen=True, eq=False)
class PendingSelection:
    """A rule about to run on a layer whose N active tokens include M candidates.

    candidate_local: [M] long, positions of the candidates among the active
    tokens (ascending); candidate_slots: the same tokens as prompt slots.
    """

    rule: SubsetRule
    candidate_local: torch.Tensor
    candidate_slots: TokenSlots
    num_active: int

    def keep_local(
        self, layer: int, new_keys: torch.Tensor, new_values: torch.Tensor, buffer: KVBuffer
    ) -> torch.Tensor:
        """Active-token indices [N'] (ascending) that stay computed: non-candidates + chosen.

        new_keys, new_values: [H_kv, N, D] computed for all N active tokens at
        `layer`; the buffer still holds the candidates' old K/V there.
        """
        new_kv = (new_keys[:, self.candidate_local], new_values[:, self.candidate_local])
        # Cloned: a gather of a contiguous run is a view the write below overwrites.
        old_keys, old_values = buffer.gather(layer, self.candidate_slots)
        old_kv = (old_keys.clone(), old_values.clone())
        chosen = torch.as_tensor(self.rule.select(layer, new_kv, old_kv), dtype=torch.long)
        chosen = chosen.to(self.candidate_local.device).flatten()
        num_candidates = int(self.candidate_local.numel())
        if chosen.numel() and not bool(((chosen >= 0) & (chosen < num_candidates)).all()):
            raise ValueError(f"selector returned indices outside [0, {num_candidates})")
        keep = torch.ones(self.num_active, dtype=torch.bool, device=chosen.device)
        keep[self.candidate_local] = False
        keep[self.candidate_local[chosen]] = True
        return keep.nonzero().squeeze(1)


class SlotWriteCache:
    """Per layer: `begin_layer(slots)`, then the layer's attention calls `update` once."""

    def __init__(self, buffer: KVBuffer) -> None:
        self.buffer = buffer
        self._slots: TokenSlots | None = None
        self._selection: PendingSelection | None = None
        self.kept_local: torch.Tensor | None = None

    def begin_layer(self, slots: TokenSlots, selection: PendingSelection | None = None) -> None:
        """The next `update` carries K/V for `slots` (the layer's active tokens, in order)."""
        self._slots = slots
        self._selection = selection
        self.kept_local = None

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key_states, value_states: [1, H_kv, N, D] (keys post-RoPE) -> [1, H_kv, T, D] views.

        With a pending selection only the kept tokens' K/V are written; the
        dropped ones keep their old (provided) K/V, and `kept_local` says which
        of the N tokens were kept. Extra arguments (`cache_kwargs` before transformers
        5.24, `kwargs=` since) carry RoPE details this cache does not need.
        """
        if self._slots is None:
            raise RuntimeError("update() before begin_layer(): the executor owns this cache")
        keys, values, slots = key_states[0], value_states[0], self._slots
        if self._selection is not None:
            self.kept_local = self._selection.keep_local(layer_idx, keys, values, self.buffer)
            slots = TokenSlots.of(
                [slots.ids[i] for i in self.kept_local.tolist()], slots.index.device
            )
            keys, values = keys[:, self.kept_local], values[:, self.kept_local]
        self.buffer.write(layer_idx, slots, keys, values)
        self._slots = None  # one update per layer; a second one is a bug
        return self.buffer.layer_view(layer_idx)
