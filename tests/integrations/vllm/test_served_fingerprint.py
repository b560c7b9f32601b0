"""The fingerprint an engine stores under, from the `VllmConfig` vLLM builds for its flags
(`EngineArgs(...).create_engine_config()`, in-process, no engine): engines that differ
only in a setting that changes K/V never share; engines that agree do."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs

from kvsplice.integrations.vllm.connector import _kv_dtype, served_fingerprint


def engine_config(model_dir: str, **flags: Any) -> VllmConfig:
    """What `vllm serve MODEL --dtype bfloat16 --max-model-len 2048 <flags>` configures."""
    args = EngineArgs(model=model_dir, dtype="bfloat16", max_model_len=2048, **flags)
    return args.create_engine_config()


def fingerprint(config: VllmConfig) -> str:
    return served_fingerprint(config.model_config, _kv_dtype(config))


def test_engines_with_the_same_flags_agree(model_dir: str) -> None:
    assert fingerprint(engine_config(model_dir)) == fingerprint(engine_config(model_dir))


@pytest.mark.parametrize(
    "flags",
    [
        {"hf_overrides": {"rms_norm_eps": 1e-3}},  # --hf-overrides '{"rms_norm_eps": 0.001}'
        {"hf_overrides": {"rope_theta": 50000.0}},
        {"quantization": "fp8"},  # --quantization fp8 (online, CPU build accepts it)
        {"quantization": "experts_int8"},
    ],
    ids=["hf-overrides-norm", "hf-overrides-rope", "quantization-fp8", "quantization-int8"],
)
def test_an_engine_differing_in_one_setting_gets_another_fingerprint(
    model_dir: str, flags: dict[str, Any]
) -> None:
    assert fingerprint(engine_config(model_dir, **flags)) != fingerprint(engine_config(model_dir))


def test_a_quantized_kv_cache_is_refused_not_shared(model_dir: str) -> None:
    config = engine_config(model_dir, kv_cache_dtype="fp8")  # --kv-cache-dtype fp8
    assert config.cache_config.cache_dtype == "fp8"  # vLLM's CPU build accepts it
    with pytest.raises(ValueError, match="unquantized KV"):
        _kv_dtype(config)


def test_the_model_dtype_is_the_kv_dtype(model_dir: str) -> None:
    half = engine_config(model_dir)
    full = EngineArgs(model=model_dir, dtype="float32", max_model_len=2048).create_engine_config()
    assert _kv_dtype(half) == "bfloat16" and _kv_dtype(full) == "float32"
    assert fingerprint(half) != fingerprint(full)
