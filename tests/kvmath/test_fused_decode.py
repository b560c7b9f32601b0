"""Fused decode oracle: dequantize + shift + write into a buffer equals the two-step path
(`decode_payload`, then `RopeSpec.shift_layers`), for every layout, partial rotary,
per-layer tables, any Δ and any destination slice; Δ = 0 is a bit-exact dequantize."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.kvmath import cpu_decode
from kvsplice.kvmath.fused_decode import decode_into
from kvsplice.kvmath.payload import decode_payload, decode_stored, encode_payload
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.rope_tables import RopeTable, default_inv_freq
from kvsplice.kvmath.segment_kv import SegmentKV

FINGERPRINT = "kvfp1-" + "a" * 32
NUM_HEADS, HEAD_DIM = 2, 16
# The RoPE space every property here ranges over (`make_rope`'s arguments and a Δ).
ROPE_CASES = {
    "layout": st.sampled_from(["rotate_half", "interleaved"]),
    "rotary_dim": st.sampled_from([HEAD_DIM, HEAD_DIM // 2]),
    "two_tables": st.booleans(),
    "delta": st.integers(-5000, 5000),
}


def make_segment(num_layers: int, num_tokens: int, start: int, seed: int) -> SegmentKV:
    generator = torch.Generator().manual_seed(seed)
    shape = (num_layers, NUM_HEADS, num_tokens, HEAD_DIM)
    keys = torch.randn(shape, generator=generator) * 3
    return SegmentKV(keys, torch.randn(shape, generator=generator), start, 0)


def make_rope(layout: str, rotary_dim: int, num_layers: int, two_tables: bool) -> RopeSpec:
    tables = tuple(
        RopeTable("default", rotary_dim, tuple(default_inv_freq(theta, rotary_dim).tolist()))
        for theta in (10_000.0, 1_000_000.0)
    )
    layer_tables = tuple((layer % 2 if two_tables else 0) for layer in range(num_layers))
    return RopeSpec(HEAD_DIM, layout, tables, layer_tables)  # type: ignore[arg-type]


def two_step(payload: bytes, rope: RopeSpec, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    segment = decode_payload(payload)
    keys = rope.shift_layers(segment.keys, delta) if delta else segment.keys
    return keys, segment.values


@settings(max_examples=40, deadline=None)
@given(
    **ROPE_CASES,
    quant=st.sampled_from(["int8", "fp16", "none"]),
    seed=st.integers(0, 2**16),
)
def test_fused_decode_equals_decode_then_shift(
    layout: str, rotary_dim: int, two_tables: bool, delta: int, quant: str, seed: int
) -> None:
    num_layers, num_tokens, start = 3, 7, 4000
    payload = encode_payload(
        make_segment(num_layers, num_tokens, start, seed),
        model_fingerprint=FINGERPRINT,
        quant=quant,
    )
    rope = make_rope(layout, rotary_dim, num_layers, two_tables)
    expected_keys, expected_values = two_step(payload, rope, delta)
    # The destination is a token slice of a larger cache-shaped buffer (strided).
    keys_buffer = torch.full((num_layers, NUM_HEADS, num_tokens + 5, HEAD_DIM), 7.0)
    values_buffer = torch.full_like(keys_buffer, 7.0)
    rows = slice(2, 2 + num_tokens)
    decode_into(
        decode_stored(payload), rope, delta, keys_buffer[:, :, rows], values_buffer[:, :, rows]
    )
    torch.testing.assert_close(keys_buffer[:, :, rows], expected_keys, rtol=0, atol=2e-5)
    assert torch.equal(values_buffer[:, :, rows], expected_values)
    assert bool(
        (keys_buffer[:, :, :2] == 7).all() and (keys_buffer[:, :, 2 + num_tokens :] == 7).all()
    )


@contextmanager
def torch_path() -> Iterator[None]:
    """decode_into without the compiled CPU kernels (the path CUDA and non-float32 take)."""
    original = cpu_decode.available
    cpu_decode.available = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        cpu_decode.available = original  # type: ignore[assignment]


@pytest.mark.skipif(not cpu_decode.available(), reason="numba is not installed")
@settings(max_examples=30, deadline=None)
@given(
    **ROPE_CASES,
    first_token=st.integers(0, 3),
    num_threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_compiled_kernels_equal_the_torch_path(
    layout: str,
    rotary_dim: int,
    two_tables: bool,
    delta: int,
    first_token: int,
    num_threads: int,
    seed: int,
) -> None:
    num_layers, num_tokens = 4, 6
    payload = encode_payload(
        make_segment(num_layers, num_tokens, 300, seed), model_fingerprint=FINGERPRINT, quant="int8"
    )
    rope = make_rope(layout, rotary_dim, num_layers, two_tables)
    outs = []
    for compiled in (True, False):
        buffer = torch.full((2, num_layers, NUM_HEADS, num_tokens + 4, HEAD_DIM), 7.0)
        rows = slice(first_token, first_token + num_tokens)
        keys, values = buffer[0, :, :, rows], buffer[1, :, :, rows]
        assert cpu_decode.writable_target(keys, keys.shape)
        previous = torch.get_num_threads()
        torch.set_num_threads(num_threads)
        try:
            with contextlib.nullcontext() if compiled else torch_path():
                decode_into(decode_stored(payload), rope, delta, keys, values)
        finally:
            torch.set_num_threads(previous)
        outs.append(buffer)
    compiled_buffer, torch_buffer = outs
    torch.testing.assert_close(compiled_buffer, torch_buffer, rtol=0, atol=2e-5)
    assert torch.equal(compiled_buffer[1], torch_buffer[1])  # values: one rounding each way
    untouched = torch.ones_like(compiled_buffer, dtype=torch.bool)
    untouched[:, :, :, first_token : first_token + num_tokens] = False
    assert bool((compiled_buffer[untouched] == 7).all())


def test_the_kernels_write_only_token_ranges_of_contiguous_float32_blocks() -> None:
    block = torch.zeros(3, 2, 10, HEAD_DIM)
    shape = (3, 2, 4, HEAD_DIM)
    assert cpu_decode.writable_target(block[:, :, 5:9], shape)
    assert cpu_decode.writable_target(torch.zeros(shape), shape)
    assert not cpu_decode.writable_target(block[:, :1, 5:9], (3, 1, 4, HEAD_DIM))  # head slice
    assert not cpu_decode.writable_target(block[:, :, 5:9].to(torch.bfloat16), shape)
    assert not cpu_decode.writable_target(
        torch.zeros(3, 2, HEAD_DIM, 4).transpose(2, 3), shape
    )  # channels not contiguous
    # Outs the kernels cannot write still decode (the torch path).
    payload = encode_payload(make_segment(3, 4, 50, 5), model_fingerprint=FINGERPRINT, quant="int8")
    rope = make_rope("rotate_half", HEAD_DIM, 3, two_tables=False)
    keys = torch.zeros(3, 2, HEAD_DIM, 4).transpose(2, 3)
    values = torch.zeros(3, 2, HEAD_DIM, 4).transpose(2, 3)
    decode_into(decode_stored(payload), rope, 11, keys, values)
    expected_keys, expected_values = two_step(payload, rope, 11)
    torch.testing.assert_close(keys, expected_keys, rtol=0, atol=2e-5)
    assert torch.equal(values, expected_values)


def test_zero_shift_is_a_bit_exact_dequantize() -> None:
    payload = encode_payload(make_segment(4, 9, 0, 1), model_fingerprint=FINGERPRINT, quant="int8")
    rope = make_rope("rotate_half", HEAD_DIM, 4, two_tables=False)
    keys, values = torch.empty(4, NUM_HEADS, 9, HEAD_DIM), torch.empty(4, NUM_HEADS, 9, HEAD_DIM)
    decode_into(decode_stored(payload), rope, 0, keys, values)
    reference = decode_payload(payload)
    assert torch.equal(keys, reference.keys) and torch.equal(values, reference.values)


def test_shift_then_unshift_is_the_identity_within_float32() -> None:
    payload = encode_payload(
        make_segment(2, 5, 100, 2), model_fingerprint=FINGERPRINT, quant="int8"
    )
    rope = make_rope("rotate_half", HEAD_DIM, 2, two_tables=False)
    keys, values = torch.empty(2, NUM_HEADS, 5, HEAD_DIM), torch.empty(2, NUM_HEADS, 5, HEAD_DIM)
    decode_into(decode_stored(payload), rope, 900, keys, values)
    back = rope.shift_layers(keys, -900)
    torch.testing.assert_close(back, decode_payload(payload).keys, rtol=0, atol=1e-4)


def test_a_bfloat16_destination_is_rounded_once_from_float32() -> None:
    payload = encode_payload(make_segment(2, 5, 10, 3), model_fingerprint=FINGERPRINT, quant="int8")
    rope = make_rope("interleaved", HEAD_DIM, 2, two_tables=False)
    keys = torch.empty(2, NUM_HEADS, 5, HEAD_DIM, dtype=torch.bfloat16)
    values = torch.empty_like(keys)
    decode_into(decode_stored(payload), rope, -3, keys, values)
    expected_keys, expected_values = two_step(payload, rope, -3)
    assert torch.equal(keys, expected_keys.to(torch.bfloat16))
    assert torch.equal(values, expected_values.to(torch.bfloat16))


def test_a_destination_of_another_shape_is_refused() -> None:
    payload = encode_payload(make_segment(2, 5, 0, 4), model_fingerprint=FINGERPRINT, quant="int8")
    rope = make_rope("rotate_half", HEAD_DIM, 2, two_tables=False)
    wrong = torch.empty(2, NUM_HEADS, 4, HEAD_DIM)
    with pytest.raises(ValueError, match="outs"):
        decode_into(decode_stored(payload), rope, 0, wrong, wrong)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_decode_on_cuda_matches_cpu_through_pinned_staging() -> None:
    payload = encode_payload(
        make_segment(3, 64, 500, 5), model_fingerprint=FINGERPRINT, quant="int8"
    )
    rope = make_rope("rotate_half", HEAD_DIM, 3, two_tables=True)
    cpu_keys, cpu_values = (
        torch.empty(3, NUM_HEADS, 64, HEAD_DIM),
        torch.empty(3, NUM_HEADS, 64, HEAD_DIM),
    )
    decode_into(decode_stored(payload), rope, -500, cpu_keys, cpu_values)
    gpu_keys = torch.empty(3, NUM_HEADS, 64, HEAD_DIM, device="cuda", dtype=torch.float16)
    gpu_values = torch.empty_like(gpu_keys)
    decode_into(decode_stored(payload), rope, -500, gpu_keys, gpu_values)
    torch.testing.assert_close(gpu_keys.float().cpu(), cpu_keys, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(gpu_values.float().cpu(), cpu_values, rtol=1e-3, atol=1e-3)
