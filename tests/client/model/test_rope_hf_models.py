"""RopeSpec against real HF forward passes of tiny random-weight models (no downloads).

Oracle: a prefill at positions s..s+T−1 must yield, at EVERY layer, the keys of a
prefill at 0..T−1 shifted by spec.shift(·, s), and the same values. Attention is
translation-invariant under RoPE, so deeper layers agree too, up to fp32 rounding.

Tolerance (stated, not tuned): HF forms angles p·inv_freq in fp32, so each run's
angle carries an error ≤ 2^-24·|p·θ_max|; the two runs differ by at most
  angle_eps = 2^-24 · θ_max · (2·(T−1) + s)       (θ_max = largest inv_freq)
which rotates a channel pair (norm ≤ √2·max|k|) by that angle. We add 16·2^-24 for
cos/sin evaluation and the mul-adds, and allow ×4 per layer for the residual
stream of deeper layers seeing equally perturbed attention (measured ≤ ×1.6):
  |Δk| ≤ √2 · max|k| · (angle_eps + 16·2^-24) · 4^layer,  same bound for values.
At T=16, s=1000, θ_max=1 this is 1.0e-4·max|k| at layer 0; mistakes are far larger
(single RoPE table on Gemma3 ≈ 1, wrong layout ≈ 1, yarn mscale applied ≈ 0.14).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvsplice.kvmath.rope import RopeSpec, UnsupportedRope  # noqa: E402

NUM_TOKENS = 16
SHIFTS = (1, 37, 1000)
ROUNDING_SLACK = 16 * 2**-24
LAYER_GROWTH = 4.0
COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "pad_token_id": 0,
}


def make_llama(rope_parameters: dict) -> object:
    return transformers.LlamaConfig(**COMMON, num_hidden_layers=2, rope_parameters=rope_parameters)


def make_gemma3() -> object:
    """Sliding layers: default θ=1e4; the full layer: θ=1e6 with linear ×8 (Gemma3 4B+)."""
    return transformers.Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=3,
        head_dim=16,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    )


CONFIGS: dict[str, Callable[[], object]] = {
    "llama-default": lambda: make_llama({"rope_type": "default", "rope_theta": 10000.0}),
    "llama-linear": lambda: make_llama({"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}),
    "llama-llama3": lambda: make_llama(
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        }
    ),
    "llama-yarn": lambda: make_llama(
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,  # = max_position_embeddings / factor
            "rope_theta": 10000.0,
        }
    ),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_hidden_layers=2),
    "mistral": lambda: transformers.MistralConfig(**COMMON, num_hidden_layers=2),
    "gemma3-per-layer": make_gemma3,
    "stablelm-partial": lambda: transformers.StableLmConfig(
        **COMMON, num_hidden_layers=2, partial_rotary_factor=0.5
    ),
    "glm-interleaved-partial": lambda: transformers.GlmConfig(
        **COMMON, num_hidden_layers=2, head_dim=16, partial_rotary_factor=0.5
    ),
}
_MODELS: dict[str, tuple[object, torch.nn.Module]] = {}
_PREFILLS: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}


def make_model(name: str) -> tuple[object, torch.nn.Module]:
    """(config, fp32 eval model) for CONFIGS[name], seeded, built once per session."""
    if name not in _MODELS:
        config = CONFIGS[name]()
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
        _MODELS[name] = (config, model)
    return _MODELS[name]


def make_token_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 128, (1, NUM_TOKENS), generator=torch.Generator().manual_seed(seed))


def prefill_kv(model: torch.nn.Module, offset: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) [H_kv, T, D] of a prefill at positions offset..offset+T−1.

    Memoized per (model, offset): the tests only read the tensors.
    """
    key = (id(model), offset)
    if key not in _PREFILLS:
        positions = (torch.arange(NUM_TOKENS) + offset)[None]
        with torch.no_grad():
            out = model(input_ids=make_token_ids(), position_ids=positions, use_cache=True)
        _PREFILLS[key] = [(layer.keys[0], layer.values[0]) for layer in out.past_key_values.layers]
    return _PREFILLS[key]


def tolerance(spec: RopeSpec, layer: int, shift: int, reference: torch.Tensor) -> float:
    theta_max = max(max(table.inv_freq) for table in spec.tables)
    angle_eps = 2**-24 * theta_max * (2 * (NUM_TOKENS - 1) + shift)
    scale = math.sqrt(2) * reference.abs().max().item()
    return scale * (angle_eps + ROUNDING_SLACK) * LAYER_GROWTH**layer


def worst_excess(spec: RopeSpec, model: torch.nn.Module) -> float:
    """max over shifts and layers of |spec.shift(k_0, s) − k_s| / tolerance (≤ 1 passes)."""
    base = prefill_kv(model, 0)
    worst = 0.0
    for shift in SHIFTS:
        for layer, ((k0, _), (ks, _)) in enumerate(
            zip(base, prefill_kv(model, shift), strict=True)
        ):
            err = (spec.shift(k0, shift, layer_idx=layer) - ks).abs().max().item()
            worst = max(worst, err / tolerance(spec, layer, shift, k0))
    return worst


def hf_rotary_buffers(model: torch.nn.Module, layer_type: str | None) -> tuple[torch.Tensor, float]:
    rotary = model.model.rotary_emb
    prefix = f"{layer_type}_" if layer_type else ""
    return getattr(rotary, f"{prefix}inv_freq"), getattr(rotary, f"{prefix}attention_scaling")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_inv_freq_and_scaling_equal_the_model_buffers_bit_for_bit(name):
    config, model = make_model(name)
    spec = RopeSpec.from_hf_config(config)
    layer_types = getattr(config, "layer_types", None) if name.startswith("gemma3") else None
    for layer in range(spec.num_layers):
        inv_freq, scaling = hf_rotary_buffers(model, layer_types[layer] if layer_types else None)
        table = spec.table(layer)
        assert torch.equal(table.inv_freq_tensor().float(), inv_freq)
        assert table.attention_scaling == scaling


@pytest.mark.parametrize("name", list(CONFIGS))
def test_shifted_prefill_keys_equal_spec_shift_at_every_layer(name):
    config, model = make_model(name)
    assert worst_excess(RopeSpec.from_hf_config(config), model) <= 1.0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_values_do_not_depend_on_the_position_offset(name):
    config, model = make_model(name)
    spec = RopeSpec.from_hf_config(config)
    base = prefill_kv(model, 0)
    for shift in SHIFTS:
        for layer, ((_, v0), (_, vs)) in enumerate(
            zip(base, prefill_kv(model, shift), strict=True)
        ):
            if layer == 0:  # nothing positional precedes layer 0's value projection
                assert torch.equal(v0, vs)
            assert (v0 - vs).abs().max().item() <= tolerance(spec, layer, shift, v0)


def test_a_single_table_fails_gemma3_so_the_oracle_has_teeth():
    config, model = make_model("gemma3-per-layer")
    single = RopeSpec.uniform(16, 10000.0, num_layers=3)
    assert RopeSpec.from_hf_config(config).layer_tables == (1, 0, 1)
    assert worst_excess(single, model) > 100.0


def test_the_wrong_layout_fails_glm():
    config, model = make_model("glm-interleaved-partial")
    assert worst_excess(RopeSpec.from_hf_config(config, layout="rotate_half"), model) > 100.0


def test_hf_rotary_emb_cos_sin_would_apply_yarn_mscale():
    """Why the shift never uses HF's rotary_emb: its cos/sin carry attention_scaling."""
    config, model = make_model("llama-yarn")
    spec = RopeSpec.from_hf_config(config)
    k0, ks = prefill_kv(model, 0)[0][0], prefill_kv(model, 37)[0][0]
    cos, sin = model.model.rotary_emb(k0, torch.full((1, NUM_TOKENS), 37))
    half = k0.shape[-1] // 2
    hf_style = k0 * cos[0] + torch.cat([-k0[..., half:], k0[..., :half]], -1) * sin[0]
    mscale_error = (hf_style - ks).abs().max().item()
    assert spec.attention_scaling(0) > 1.1
    assert mscale_error > 100.0 * tolerance(spec, 0, 37, k0)


def test_dynamic_ntk_is_refused():
    config = make_llama({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedRope, match="dynamic"):
        RopeSpec.from_hf_config(config)


def test_longrope_is_refused():
    config = transformers.Phi3Config(
        **COMMON,
        num_hidden_layers=2,
        original_max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "rope_theta": 10000.0,
        },
    )
    with pytest.raises(UnsupportedRope, match="longrope"):
        RopeSpec.from_hf_config(config)
