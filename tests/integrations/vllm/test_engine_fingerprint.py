"""The fingerprint an engine's chains hang from: its files, and its settings that change K/V."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvsplice.common.keys import is_fingerprint
from kvsplice.integrations.vllm.engine_fingerprint import effective_fingerprint, engine_fingerprint


def model_dir(tmp_path: Path, weights: bytes = b"w" * 64) -> Path:
    tmp_path.mkdir()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 1e4}))
    (tmp_path / "model.safetensors").write_bytes(weights)
    (tmp_path / "tokenizer.json").write_text("{}")
    return tmp_path


def test_the_files_and_the_kv_dtype_name_the_model(tmp_path: Path) -> None:
    a = engine_fingerprint(model_dir(tmp_path / "a"), "bfloat16", digest_cache=None)
    same = engine_fingerprint(model_dir(tmp_path / "b"), "bfloat16", digest_cache=None)
    other_weights = engine_fingerprint(
        model_dir(tmp_path / "c", b"x" * 64), "bfloat16", digest_cache=None
    )
    other_dtype = engine_fingerprint(model_dir(tmp_path / "d"), "float32", digest_cache=None)
    assert a == same and len({a, other_weights, other_dtype}) == 3 and is_fingerprint(a)


@pytest.mark.parametrize(
    "change",
    [
        {"quantization": "fp8"},  # online quantization: other weights, other K/V
        {"hf_overrides": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}},
        {"rope": {"rope_theta": 5e5}},  # what vLLM resolved differs from the files
    ],
)
def test_settings_that_change_kv_change_the_fingerprint(change: dict) -> None:
    files = "kvfp1-" + "ab" * 16
    base = {"quantization": None, "hf_overrides": {}, "rope": {"rope_theta": 1e4}}
    assert effective_fingerprint(files, base) == effective_fingerprint(files, dict(base))
    changed = effective_fingerprint(files, {**base, **change})
    assert changed != effective_fingerprint(files, base) and is_fingerprint(changed)


def test_the_connector_reads_the_engines_effective_settings() -> None:
    connector = pytest.importorskip("kvsplice.integrations.vllm.connector")
    text = SimpleNamespace(rope_theta=1e4, rope_scaling={"factor": 2.0}, head_dim=64)
    model = SimpleNamespace(hf_text_config=text, hf_overrides={"x": 1}, quantization="fp8")
    settings = connector._engine_settings(model)
    assert settings == {
        "quantization": "fp8",
        "hf_overrides": {"x": 1},
        "rope": {"rope_theta": 1e4, "rope_scaling": {"factor": 2.0}, "head_dim": 64},
    }


def test_an_explicit_fail_policy_is_respected_and_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    connector = pytest.importorskip("kvsplice.integrations.vllm.connector")
    transfer = SimpleNamespace(kv_load_failure_policy="fail")
    with caplog.at_level(logging.WARNING):
        connector._warn_if_failing_requests(transfer)
    assert transfer.kv_load_failure_policy == "fail"
    assert "recompute" in caplog.text
