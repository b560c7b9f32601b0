"""Approximate runs into the paged cache, against a RoPE oracle: the keys a run writes are
the keys computed at its new positions.

The oracle: keys R(p)·x of pre-RoPE states x computed at positions 4..8 are stored; loaded
as positions 8..12 of another request, the cache must hold R(p')·x at p' = 8..12 (values as
stored). The same load with the Δ left out (`decode_into` patched to move by 0) must fail
the oracle: the test can tell a moved key from an unmoved one.
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers.vllm_worker import (
    BLOCK,
    DIM,
    FINGERPRINT,
    HEADS,
    LAYERS,
    NS,
    FakeStore,
    make_worker,
    synthetic_layout,
)

from kvsplice.common.keys import root_key
from kvsplice.common.segment import chained_meta
from kvsplice.integrations.vllm import span_writer
from kvsplice.integrations.vllm.negative_controls import NOISE, UNROTATED, damage, damage_in_place
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.integrations.vllm.transfer_specs import LoadSpec
from kvsplice.kvmath.fused_decode import decode_into
from kvsplice.kvmath.payload import encode_payload
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

ROPE = RopeSpec.uniform(DIM, 10_000.0, LAYERS)
OLD, NEW = 4, 8  # where the run was computed, where it is loaded
TOKENS = tuple(range(200, 200 + BLOCK))
# int8 keys round each channel to 1/127 of its largest value: the oracle holds within that
TOLERANCE = {"none": 1e-5, "int8": 0.05}


def at_positions(states: torch.Tensor, start: int) -> torch.Tensor:
    """Pre-RoPE states [L, H, T, D] rotated to positions start.. (RoPE applied there)."""
    return ROPE.shift_layers(states, torch.arange(start, start + states.shape[2]))


def store_run(store: FakeStore, quant: str) -> tuple[ReusedSpan, torch.Tensor, torch.Tensor]:
    """One segment of BLOCK tokens computed at OLD: its span as loaded at NEW, the pre-RoPE
    states of its keys, and its values."""
    gen = torch.Generator().manual_seed(7)
    states = torch.randn(LAYERS, HEADS, BLOCK, DIM, generator=gen)
    values = torch.randn(LAYERS, HEADS, BLOCK, DIM, generator=gen)
    meta = chained_meta(
        NS, FINGERPRINT, root_key(FINGERPRINT), TOKENS, OLD, LAYERS, created_at_s=time.time()
    )
    kv = SegmentKV(at_positions(states, OLD), values, start_position=OLD)
    store.put_segment(meta, encode_payload(kv, model_fingerprint=FINGERPRINT, quant=quant))
    return ReusedSpan(meta.segment_id, NEW, BLOCK, 0, OLD), states, values


def load_at_new(store: FakeStore, span: ReusedSpan) -> tuple[torch.Tensor, torch.Tensor]:
    """Load the span into block 5 of a fresh worker; the keys and values block 5 then holds."""
    reader = make_worker(store, seed=None, rope=ROPE)
    tokens = (7,) * NEW + TOKENS
    spec = LoadSpec("r", NS, FINGERPRINT, NEW, NEW + BLOCK, (5,), tokens, (), spans=(span,))
    assert reader.load(spec) == set()
    layout = synthetic_layout()
    written = [layout.gather(cache, torch.tensor([5])) for cache in reader.paged.caches]
    return torch.stack([k for k, _ in written]), torch.stack([v for _, v in written])


@pytest.mark.parametrize("quant", ["none", "int8"])
@pytest.mark.parametrize("shifted", [True, False], ids=["moved", "broken-unmoved"])
def test_a_run_s_keys_equal_the_keys_computed_at_its_new_positions(
    quant: str, shifted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`moved` must meet the oracle; `broken-unmoved` (the Δ left out) must miss it."""
    store = FakeStore()
    span, states, values = store_run(store, quant)
    assert span.delta == NEW - OLD
    if not shifted:
        monkeypatch.setattr(
            span_writer, "decode_into",
            lambda run, rope, delta, k, v, staging=None: decode_into(run, rope, 0, k, v, staging),
        )  # fmt: skip
    keys, written_values = load_at_new(store, span)
    oracle = at_positions(states, NEW)
    tolerance = TOLERANCE[quant]
    assert torch.allclose(keys, oracle, atol=tolerance) is shifted
    assert torch.allclose(written_values, values, atol=tolerance)
    if not shifted:  # what the broken load wrote: the keys where they were computed
        assert torch.allclose(keys, at_positions(states, OLD), atol=tolerance)


def test_every_run_goes_through_decode_into(monkeypatch: pytest.MonkeyPatch) -> None:
    store = FakeStore()
    span, _, _ = store_run(store, "none")
    deltas: list[int] = []

    def spy(*args: object) -> None:
        deltas.append(args[2])  # type: ignore[arg-type]
        decode_into(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(span_writer, "decode_into", spy)
    load_at_new(store, span)
    assert deltas == [NEW - OLD]


@pytest.mark.parametrize("control", [UNROTATED, NOISE])
def test_a_control_damages_in_place_what_damage_returns(control: str) -> None:
    """The worker damages runs already written (`applied_delta`, `damage_in_place`) as the
    drift script does from tensors (`damage`)."""
    gen = torch.Generator().manual_seed(3)
    stored, values = torch.randn(2, LAYERS, HEADS, BLOCK, DIM, generator=gen)
    moved = ROPE.shift_layers(stored, NEW - OLD)
    keys_out = (stored if control == UNROTATED else moved).clone()
    values_out = values.clone()
    damage_in_place(control, keys_out, values_out, "seg:0:8")
    want_keys, want_values = damage(control, stored, moved, values, "seg:0:8")
    assert torch.equal(keys_out, want_keys) and torch.equal(values_out, want_values)
