"""Oracles for kvmath.quant: the stated int8 bound, grouping, bit-exact pass-through."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.kvmath.quant import (
    INT8_MAX,
    KEY_GROUP_DIM,
    SCALE_FLOOR,
    VALUE_GROUP_DIM,
    StoredTensor,
    dequantize,
    dequantize_int8,
    quantize,
    quantize_int8,
    store_exact,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# log2 of the data's scale: each dtype's normal range, reaching into subnormals,
# leaving room for a 1000x outlier on ~5-sigma values.
LOG2_RANGE = {torch.float32: (-140, 100), torch.float16: (-20, 2), torch.bfloat16: (-130, 100)}
PATTERNS = ("gauss", "zeros", "outlier", "negative", "outlier_channels", "ties")


def make_kv(
    shape: tuple[int, ...], *, seed: int, log2_scale: int, dtype: torch.dtype, pattern: str
) -> torch.Tensor:
    """[L, H, T, D] test data in `dtype`; `pattern` adds the hard cases for int8."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if pattern == "zeros":
        x.zero_()
    elif pattern == "outlier":
        x.view(-1)[int(torch.randint(x.numel(), (1,), generator=g))] *= 1000.0
    elif pattern == "negative":
        x = -x.abs()
    elif pattern == "outlier_channels":
        x[..., 0] *= 100.0
        x[..., -1] += 50.0
    elif pattern == "ties":  # x / scale lands on k + 1/2: rounding's worst case
        x = (torch.randint(-127, 127, shape, generator=g).double() + 0.5) / INT8_MAX
        x[..., 0, :] = 1.0  # every key channel and value token has max |x| = 1
        x[..., :, 0] = 1.0
    return (x * 2.0**log2_scale).to(dtype)


@st.composite
def kv_cases(draw: st.DrawFn) -> torch.Tensor:
    shape = tuple(draw(st.integers(1, n)) for n in (3, 3, 17, 9))
    dtype = draw(st.sampled_from(DTYPES))
    lo, hi = LOG2_RANGE[dtype]
    return make_kv(
        shape,
        seed=draw(st.integers(0, 2**31)),
        log2_scale=draw(st.integers(lo, hi)),
        dtype=dtype,
        pattern=draw(st.sampled_from(PATTERNS)),
    )


def assert_within_int8_bound(x: torch.Tensor, x_hat: torch.Tensor, scale: torch.Tensor) -> None:
    """The documented bound |x - x̂| <= scale * (1/2 + 2**-16), checked in float64."""
    err = (x.double() - x_hat.double()).abs()
    bound = scale.double() * (0.5 + 2.0**-16)
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item()}"


@settings(max_examples=100, deadline=None)
@given(x=kv_cases(), group_dim=st.sampled_from([KEY_GROUP_DIM, VALUE_GROUP_DIM]))
def test_int8_error_is_within_the_stated_bound(x: torch.Tensor, group_dim: int) -> None:
    q, scale = quantize_int8(x, group_dim)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= INT8_MAX
    assert_within_int8_bound(x, dequantize_int8(q, scale), scale)


@settings(max_examples=60, deadline=None)
@given(x=kv_cases(), group_dim=st.sampled_from([KEY_GROUP_DIM, VALUE_GROUP_DIM]))
def test_scale_is_group_max_over_127(x: torch.Tensor, group_dim: int) -> None:
    _, scale = quantize_int8(x, group_dim)
    expected_shape = list(x.shape)
    expected_shape[group_dim] = 1
    assert list(scale.shape) == expected_shape and scale.dtype == torch.float32
    amax = x.double().abs().amax(dim=group_dim, keepdim=True).clamp(min=SCALE_FLOOR)
    assert torch.allclose(scale.double() * INT8_MAX, amax, rtol=2.0**-23, atol=0.0)


def test_keys_group_per_channel_values_per_token() -> None:
    x = make_kv((2, 3, 16, 8), seed=1, log2_scale=0, dtype=torch.float32, pattern="gauss")
    others = [c for c in range(8) if c != 3]
    boosted_channel = x.clone()
    boosted_channel[..., 3] *= 1024.0
    q, scale = quantize_int8(x, KEY_GROUP_DIM)
    qb, scale_b = quantize_int8(boosted_channel, KEY_GROUP_DIM)
    assert torch.equal(q[..., others], qb[..., others])  # other channels' groups untouched
    assert torch.equal(scale_b[..., 3], scale[..., 3] * 1024.0)  # scales are exact powers apart
    assert torch.equal(q[..., 3], qb[..., 3])
    boosted_token = x.clone()
    boosted_token[..., 5, :] *= 1024.0
    q, scale = quantize_int8(x, VALUE_GROUP_DIM)
    qb, scale_b = quantize_int8(boosted_token, VALUE_GROUP_DIM)
    assert torch.equal(q, qb) and torch.equal(scale_b[..., 5, :], scale[..., 5, :] * 1024.0)


def test_all_zero_groups_decode_to_exact_zeros() -> None:
    x = torch.zeros(2, 1, 4, 8)
    x[0, 0, 1, 2] = 3.0
    for group_dim in (KEY_GROUP_DIM, VALUE_GROUP_DIM):
        q, scale = quantize_int8(x, group_dim)
        assert torch.equal(dequantize_int8(q, scale)[1], torch.zeros(1, 4, 8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_int8_refuses_non_finite_input(bad: float) -> None:
    x = torch.zeros(1, 1, 2, 4)
    x[0, 0, 1, 1] = bad
    with pytest.raises(ValueError, match="finite"):
        quantize_int8(x, KEY_GROUP_DIM)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_half_outputs_are_the_float32_result_rounded_once(out_dtype: torch.dtype) -> None:
    x = make_kv((3, 2, 9, 8), seed=2, log2_scale=0, dtype=torch.float32, pattern="gauss")
    q, scale = quantize_int8(x, VALUE_GROUP_DIM)
    expected = dequantize_int8(q, scale).to(out_dtype)
    assert torch.equal(dequantize_int8(q, scale, out_dtype), expected)
    assert torch.equal(dequantize_int8(q.numpy(), scale.numpy(), out_dtype), expected)


@pytest.mark.filterwarnings("error")
def test_dequantize_reads_read_only_views_without_copy_warnings() -> None:
    x = make_kv((2, 2, 5, 8), seed=3, log2_scale=0, dtype=torch.float32, pattern="gauss")
    q, scale = quantize_int8(x, KEY_GROUP_DIM)
    q_ro = np.frombuffer(q.numpy().tobytes(), np.int8).reshape(q.shape)
    scale_ro = np.frombuffer(scale.numpy().tobytes(), np.float32).reshape(scale.shape)
    stored = StoredTensor(q_ro, "int8", scale_ro)
    assert torch.equal(dequantize(stored), dequantize_int8(q, scale))


@settings(max_examples=40, deadline=None)
@given(x=kv_cases())
def test_none_is_bit_exact_in_the_captured_dtype(x: torch.Tensor) -> None:
    stored = quantize(x, "none", KEY_GROUP_DIM)
    back = dequantize(stored, x.dtype)
    assert back.dtype == x.dtype and torch.equal(back.view(torch.int8), x.view(torch.int8))
    assert torch.equal(dequantize(store_exact(x), x.dtype).view(torch.int8), x.view(torch.int8))


@settings(max_examples=40, deadline=None)
@given(x=kv_cases())
def test_fp16_scheme_is_a_single_rounding_to_float16(x: torch.Tensor) -> None:
    if not bool(torch.isfinite(x.to(torch.float16)).all()):  # 65504 < |x| < 65520 rounds down
        with pytest.raises(ValueError, match="fp16"):
            quantize(x, "fp16", KEY_GROUP_DIM)
        return
    stored = quantize(x, "fp16", KEY_GROUP_DIM)
    assert stored.kind == "float16"
    assert torch.equal(dequantize(stored, torch.float32), x.to(torch.float16).float())


def test_stored_tensor_rejects_inconsistent_parts() -> None:
    with pytest.raises(ValueError, match="kind"):
        StoredTensor(np.zeros(3, np.float32), "int4")
    with pytest.raises(ValueError, match="dtype"):
        StoredTensor(np.zeros(3, np.float32), "int8", np.ones(1, np.float32))
    with pytest.raises(ValueError, match="scale"):
        StoredTensor(np.zeros(3, np.int8), "int8")


@pytest.mark.parametrize("per", ["channel", "token"])
def test_compiled_dequantize_is_bit_identical_to_the_torch_path(per: str) -> None:
    from kvsplice.kvmath import cpu_decode

    if not cpu_decode.available():
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(3)
    q = rng.integers(-127, 128, (3, 2, 9, 16), dtype=np.int8)
    shape = (3, 2, 1, 16) if per == "channel" else (3, 2, 9, 1)
    scale = (rng.random(shape, dtype=np.float32) * 0.2 + 1e-3).astype(np.float32)
    q.flags.writeable = False  # payload views are read-only
    compiled = dequantize_int8(q, scale)
    original = cpu_decode.available
    cpu_decode.available = lambda: False  # type: ignore[assignment]
    try:
        reference = dequantize_int8(q, scale)
    finally:
        cpu_decode.available = original  # type: ignore[assignment]
    assert torch.equal(compiled, reference)
    assert torch.equal(reference, torch.from_numpy(q.astype(np.float32) * scale))
