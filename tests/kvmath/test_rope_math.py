"""Oracles for kvmath.rope: R(Δ)R(p) = R(p+Δ), round trips, bit-exact no-ops, references.

Tolerances (measured over 300 random shapes/offsets up to 131072, see the report):
- shift-vs-direct oracle: ≤ 1e-6·max|x| in fp32 (worst seen 1.7e-7), ≤ 1e-12 in fp64
  (worst seen 4.4e-16); angles are fp64 in both, so the bound does not grow with p.
- round trip shift(Δ) then shift(−Δ): ≤ 4·2^-24·max|k| in fp32 (worst seen 2.7),
  ≤ 2·2^-8·max|k| in bf16 (two bf16 roundings of a pair of norm ≤ √2·max|k|).
"""

from __future__ import annotations

import json
import math
import pickle
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.common.errors import UnsupportedRope
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.rope_tables import (
    default_inv_freq,
    linear_inv_freq,
    llama3_inv_freq,
    yarn_attention_scaling,
    yarn_inv_freq,
)

LAYOUTS = ("rotate_half", "interleaved")
POSITIONS = (0, 17, 4095, 131000, 131072)
FP32_ORACLE_REL = 1e-6
FP64_ORACLE_REL = 1e-12
FP32_ROUND_TRIP_REL = 4 * 2**-24
BF16_ROUND_TRIP_REL = 2 * 2**-8


def make_keys(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def make_spec(
    layout: str = "rotate_half",
    head_dim: int = 64,
    rotary_dim: int | None = None,
    theta: float = 500000.0,
    num_layers: int = 1,
) -> RopeSpec:
    return RopeSpec.uniform(head_dim, theta, num_layers, layout=layout, rotary_dim=rotary_dim)


def make_config(**fields: object) -> types.SimpleNamespace:
    """A duck-typed HF config: hidden 64, 4 heads (head_dim 16), 2 layers by default."""
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}
    base.update(fields)
    return types.SimpleNamespace(**base)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of t's bit patterns (distinguishes −0.0 from +0.0)."""
    int_dtype = {torch.float32: torch.int32, torch.float64: torch.int64}.get(t.dtype, torch.int16)
    return t.contiguous().view(int_dtype)


def reference_rotate(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, layout: str
) -> torch.Tensor:
    """Textbook RoPE in float64 with torch.cat / repeat_interleave (independent of RopeSpec).

    x: [..., T, D]; positions: [T]; inv_freq: [rotary_dim/2].
    """
    rotary_dim = 2 * inv_freq.numel()
    x64, rest = x[..., :rotary_dim].double(), x[..., rotary_dim:].double()
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    if layout == "rotate_half":
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        half = rotary_dim // 2
        rotated_half = torch.cat([-x64[..., half:], x64[..., :half]], -1)
    else:
        cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
        rotated_half = torch.stack([-x64[..., 1::2], x64[..., 0::2]], -1).flatten(-2)
    return torch.cat([x64 * cos + rotated_half * sin, rest], -1)


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / scale.double().abs().max()).item()


# ----- (a) shift oracle -------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shift_of_rotated_equals_rotation_at_new_position(layout, rotary_dim, dtype):
    spec = make_spec(layout, rotary_dim=rotary_dim)
    x = make_keys(2, 4, 64, dtype=dtype)
    bound = FP32_ORACLE_REL if dtype == torch.float32 else FP64_ORACLE_REL
    for p in POSITIONS:
        positions = p + torch.arange(4)
        at_p = spec.rotate(x, positions)
        for delta in (-p, -1, 0, 1, 7777):
            direct = spec.rotate(x, positions + delta)
            assert rel_err(spec.shift(at_p, delta), direct, x) <= bound, (p, delta)


@settings(max_examples=60, deadline=None)
@given(
    num_heads=st.integers(1, 4),
    num_tokens=st.integers(1, 12),
    half_dim=st.integers(1, 64),
    rotary_fraction=st.floats(0.01, 1.0),
    layout=st.sampled_from(LAYOUTS),
    p=st.integers(0, 131072),
    delta_raw=st.integers(0, 2 * 131072),
)
def test_shift_oracle_over_shapes_and_offsets(
    num_heads, num_tokens, half_dim, rotary_fraction, layout, p, delta_raw
):
    head_dim = 2 * half_dim
    rotary_dim = 2 * max(1, round(half_dim * rotary_fraction))
    delta = delta_raw - p  # Δ ∈ [−p, 2·131072 − p]: new positions stay ≥ 0
    spec = make_spec(layout, head_dim=head_dim, rotary_dim=rotary_dim, theta=10000.0)
    x = make_keys(num_heads, num_tokens, head_dim, seed=p)
    positions = p + torch.arange(num_tokens)
    shifted = spec.shift(spec.rotate(x, positions), delta)
    assert rel_err(shifted, spec.rotate(x, positions + delta), x) <= FP32_ORACLE_REL


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_dim", [64, 40])
def test_rotate_matches_textbook_reference(layout, rotary_dim):
    spec = make_spec(layout, rotary_dim=rotary_dim)
    x = make_keys(3, 6, 64, dtype=torch.float64)
    positions = torch.tensor([0, 1, 17, 4095, 131000, 131072])
    inv_freq = spec.table(0).inv_freq_tensor()
    expected = reference_rotate(x, positions, inv_freq, layout)
    assert rel_err(spec.rotate(x, positions), expected, x) <= FP64_ORACLE_REL


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        # pairs (x0, x1) by π/2 and (x2, x3) by π/4
        ("interleaved", [-2.0, 1.0, -1 / math.sqrt(2), 7 / math.sqrt(2)]),
        # pairs (x0, x2) by π/2 and (x1, x3) by π/4
        ("rotate_half", [-3.0, -math.sqrt(2), 1.0, 3 * math.sqrt(2)]),
    ],
)
def test_four_dim_vector_with_known_angles(layout, expected):
    spec = RopeSpec.uniform(4, 1.0, layout=layout, inv_freq=[math.pi / 2, math.pi / 4])
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    assert torch.allclose(
        spec.shift(x, 1)[0], torch.tensor(expected, dtype=torch.float64), atol=1e-12
    )


# ----- (b) identities ------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("delta", [1, -1, 7777, 131072, -131000])
def test_round_trip_returns_input_within_four_half_ulps(layout, delta):
    spec = make_spec(layout, rotary_dim=48)
    k = make_keys(3, 16, 64)
    back = spec.shift(spec.shift(k, delta), -delta)
    assert rel_err(back, k, k) <= FP32_ROUND_TRIP_REL


@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_in_bf16_is_two_roundings(layout):
    spec = make_spec(layout)
    k = make_keys(3, 16, 64, dtype=torch.bfloat16)
    back = spec.shift(spec.shift(k, 4093), -4093)
    assert back.dtype == torch.bfloat16
    assert rel_err(back, k, k) <= BF16_ROUND_TRIP_REL


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_zero_delta_is_a_bit_exact_copy(layout, dtype):
    spec = make_spec(layout, rotary_dim=32)
    k = make_keys(2, 5, 64, dtype=dtype)
    k[0, 0, :4] = -0.0
    for zero in (0, torch.zeros(5, dtype=torch.long)):
        out = spec.shift(k, zero)
        assert torch.equal(bits(out), bits(k))
        assert out.data_ptr() != k.data_ptr()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pass_through_channels_are_bit_identical(layout, dtype):
    spec = make_spec(layout, rotary_dim=24)
    k = make_keys(2, 7, 64, dtype=dtype)
    k[..., 30:34] = -0.0
    for delta in (5, torch.arange(7) - 3):
        out = spec.shift(k, delta)
        assert torch.equal(bits(out[..., 24:]), bits(k[..., 24:]))
        assert not torch.equal(out[..., :24], k[..., :24])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_per_token_delta_equals_individual_int_shifts(layout):
    spec = make_spec(layout, rotary_dim=48)
    k = make_keys(3, 6, 64)
    deltas = torch.tensor([0, 1, -1, 17, -4095, 131000])
    out = spec.shift(k, deltas)
    for t, delta in enumerate(deltas.tolist()):
        assert torch.equal(out[:, t], spec.shift(k[:, t : t + 1], delta)[:, 0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_and_odd_offset_views_shift_like_contiguous_copies(layout):
    spec = make_spec(layout, head_dim=8)
    flat = make_keys(1 + 3 * 10 * 8)
    odd_offset = flat[1:].view(3, 10, 8)
    every_other_token = make_keys(3, 20, 8)[:, ::2]
    for k in (odd_offset, every_other_token):
        assert torch.equal(spec.shift(k, 11), spec.shift(k.contiguous(), 11))


def test_gqa_heads_are_shifted_independently():
    spec = make_spec()
    k = make_keys(4, 8, 64)
    together = spec.shift(k, 321)
    for head in range(4):
        assert torch.equal(together[head], spec.shift(k[head], 321))


# ----- shift_layers: per-layer tables, grouping --------------------------------


def make_two_table_spec(layout: str, rotary_dims: tuple[int, int]) -> RopeSpec:
    local = make_spec(layout, rotary_dim=rotary_dims[0], theta=10000.0).tables[0]
    global_ = make_spec(layout, rotary_dim=rotary_dims[1], theta=1e6).tables[0]
    return RopeSpec(64, layout, (local, global_), (0, 0, 1, 0, 1, 1))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary_dims", [(64, 64), (64, 32)])
@pytest.mark.parametrize("delta", [37, "per_token"])
def test_shift_layers_equals_per_layer_shift(layout, rotary_dims, delta):
    spec = make_two_table_spec(layout, rotary_dims)
    k_all = make_keys(5, 2, 8, 64)
    delta = torch.arange(8) * 3 - 5 if delta == "per_token" else delta
    out = spec.shift_layers(k_all, delta, layer_start=1)
    for i in range(5):
        assert torch.equal(out[i], spec.shift(k_all[i], delta, layer_idx=1 + i))


def test_per_layer_tables_rotate_differently():
    spec = make_two_table_spec("rotate_half", (64, 64))
    k = make_keys(2, 3, 64)
    assert rel_err(spec.shift(k, 1000, layer_idx=0), spec.shift(k, 1000, layer_idx=2), k) > 0.1


def test_cached_int_operands_give_identical_results():
    spec = make_spec(num_layers=3)
    k_all = make_keys(3, 2, 8, 64)
    first = spec.shift_layers(k_all, 99)
    for delta in range(200):  # churn the LRU, then recompute
        spec.shift_layers(k_all[:1], delta)
    assert torch.equal(spec.shift_layers(k_all, 99), first)


def test_spec_survives_pickling_and_stays_hashable():
    spec = make_two_table_spec("interleaved", (64, 32))
    spec.shift(make_keys(2, 3, 64), 5)  # warm the operand cache
    clone = pickle.loads(pickle.dumps(spec))
    assert clone == spec and hash(clone) == hash(spec)
    k = make_keys(2, 3, 64)
    assert torch.equal(clone.shift(k, 5, layer_idx=2), spec.shift(k, 5, layer_idx=2))


# ----- validation --------------------------------------------------------------


def test_invalid_inputs_raise_value_error():
    spec = make_spec(num_layers=2)
    k = make_keys(2, 4, 64)
    with pytest.raises(ValueError, match="integer"):
        spec.shift(k, torch.ones(4))
    with pytest.raises(ValueError, match="T=4"):
        spec.shift(k, torch.ones(5, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        spec.shift(k, 1, layer_idx=2)
    with pytest.raises(ValueError, match="D=64"):
        spec.shift(make_keys(2, 4, 32), 1)
    with pytest.raises(ValueError, match="layout"):
        RopeSpec.uniform(64, 1e4, layout="sideways")  # type: ignore[arg-type]


# ----- tables: rope-type invariants ------------------------------------------------


def test_linear_divides_every_frequency_by_factor():
    assert torch.equal(linear_inv_freq(1e4, 64, 4.0), default_inv_freq(1e4, 64) / 4.0)


def test_llama3_keeps_short_wavelengths_and_scales_long_ones():
    base = default_inv_freq(500000.0, 128)
    scaled = llama3_inv_freq(500000.0, 128, 8.0, 1.0, 4.0, 8192)
    wavelen = 2 * math.pi / base
    short, long = wavelen < 8192 / 4.0, wavelen > 8192 / 1.0
    assert torch.equal(scaled[short], base[short])
    assert torch.equal(scaled[long], base[long] / 8.0)
    middle = ~short & ~long
    assert bool(((scaled[middle] < base[middle]) & (scaled[middle] > base[middle] / 8)).all())


def test_yarn_extrapolates_fast_dims_and_interpolates_slow_ones():
    base = default_inv_freq(1e4, 64)
    scaled = yarn_inv_freq(1e4, 64, factor=4.0, original_max=256)
    assert scaled[0] == base[0]
    assert torch.allclose(scaled[-1], base[-1] / 4.0, rtol=1e-6)
    assert yarn_attention_scaling(4.0, {}) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert yarn_attention_scaling(4.0, {"attention_factor": 1.5}) == 1.5


# ----- from_hf_config on duck-typed configs -----------------------------------------


def test_flat_v5_config_builds_one_table():
    cfg = make_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    spec = RopeSpec.from_hf_config(cfg)
    assert (spec.num_layers, spec.head_dim, spec.layout) == (2, 16, "rotate_half")
    assert spec.layer_tables == (0, 0)
    assert spec.table(0).inv_freq == tuple(linear_inv_freq(1e4, 16, 2.0).tolist())


def test_nested_gemma3_config_maps_layer_types_to_tables():
    cfg = make_config(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    )
    spec = RopeSpec.from_hf_config(cfg)
    assert spec.table(0) == spec.table(2) != spec.table(1)
    assert spec.table(1).inv_freq == tuple(linear_inv_freq(1e6, 16, 8.0).tolist())


def test_v4_fields_are_read_when_rope_parameters_is_absent():
    legacy_gemma = make_config(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"type": "linear", "factor": 8.0},
    )
    spec = RopeSpec.from_hf_config(legacy_gemma)
    assert spec.table(0).inv_freq == tuple(default_inv_freq(1e4, 16).tolist())
    assert spec.table(1).inv_freq == tuple(linear_inv_freq(1e6, 16, 8.0).tolist())


def test_partial_rotary_and_interleaved_layout_from_config():
    cfg = make_config(
        model_type="glm", head_dim=32, rope_parameters={"rope_theta": 1e4, "rope_type": "default"}
    )
    cfg.partial_rotary_factor = 0.5
    spec = RopeSpec.from_hf_config(cfg)
    assert (spec.layout, spec.head_dim, spec.rotary_dim(0)) == ("interleaved", 32, 16)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
        {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8},
        {"rope_type": "proportional", "rope_theta": 1e4},
        {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
    ],
)
def test_non_pure_rope_types_are_refused(params):
    with pytest.raises(UnsupportedRope):
        RopeSpec.from_hf_config(make_config(rope_parameters=params))


def test_to_dict_is_canonical_json_and_distinguishes_tables():
    def dumped(theta: float) -> str:
        cfg = make_config(rope_parameters={"rope_type": "default", "rope_theta": theta})
        return json.dumps(RopeSpec.from_hf_config(cfg).to_dict(), sort_keys=True)

    assert dumped(1e4) == dumped(1e4)
    assert dumped(1e4) != dumped(1e5)
    assert json.loads(dumped(1e4))["layer_tables"] == [0, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_shift_matches_cpu(layout):
    spec = make_spec(layout, rotary_dim=48, num_layers=2)
    k_all = make_keys(2, 3, 32, 64)
    deltas = torch.arange(32) * 1000
    on_gpu = spec.shift_layers(k_all.cuda(), deltas.cuda()).cpu()
    assert rel_err(on_gpu, spec.shift_layers(k_all, deltas), k_all) <= FP32_ORACLE_REL
