"""Model loading and the model fingerprint: stable across processes, sensitive to every part."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.model import make_tiny_gemma3, make_tiny_llama, make_word_tokenizer

from kvsplice.client.model import models
from kvsplice.client.model.fingerprinting import architecture_dict, model_fingerprint
from kvsplice.client.model.models import (
    LoadedModel,
    ModelConfig,
    bundle_model,
    kv_layout,
    load_model,
)
from kvsplice.common.keys import is_fingerprint
from kvsplice.common.layout import KVLayout


def make_saved_tiny_model(directory: Path) -> Path:
    make_tiny_llama().save_pretrained(directory)
    make_word_tokenizer().save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("source", "/nonexistent/model"),
        ("dtype", "int8"),
        ("device", ""),
        ("attn_implementation", "flash"),
    ],
)
def test_model_config_rejects_bad_values_naming_them(field: str, value: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{field: value})


def test_kv_layout_reads_gqa_geometry_and_explicit_head_dim() -> None:
    assert kv_layout(make_tiny_llama()) == KVLayout(2, 2, 16, 64, "float32")
    assert kv_layout(make_tiny_gemma3()) == KVLayout(3, 2, 16, 64, "float32")


def test_fingerprint_is_well_formed_and_deterministic() -> None:
    first = model_fingerprint(make_tiny_llama(), make_word_tokenizer(), "float32")
    second = model_fingerprint(make_tiny_llama(), make_word_tokenizer(), "float32")
    assert is_fingerprint(first)
    assert first == second


def test_fingerprint_changes_with_one_weight_element() -> None:
    model, tokenizer = make_tiny_llama(), make_word_tokenizer()
    before = model_fingerprint(model, tokenizer, "float32")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-6
    assert model_fingerprint(model, tokenizer, "float32") != before


def test_fingerprint_changes_with_rope_theta_vocab_entry_and_kv_dtype() -> None:
    base = model_fingerprint(make_tiny_llama(), make_word_tokenizer(), "float32")
    other_rope = model_fingerprint(
        make_tiny_llama(rope_theta=20000.0), make_word_tokenizer(), "float32"
    )
    other_vocab = model_fingerprint(
        make_tiny_llama(), make_word_tokenizer({"w7": "seven"}), "float32"
    )
    other_dtype = model_fingerprint(make_tiny_llama(), make_word_tokenizer(), "bfloat16")
    assert len({base, other_rope, other_vocab, other_dtype}) == 4


def test_architecture_ignores_provenance_fields() -> None:
    model = make_tiny_llama()
    before = architecture_dict(model.config)
    model.config._name_or_path = "/somewhere/else"
    assert architecture_dict(model.config) == before
    assert "transformers_version" not in before


def test_load_local_directory_bundles_layout_rope_and_fingerprint(tmp_path: Path) -> None:
    loaded = load_model(ModelConfig(source=str(make_saved_tiny_model(tmp_path))))
    assert not loaded.model.training
    assert loaded.layout == KVLayout(2, 2, 16, 64, "float32")
    assert loaded.rope.num_layers == 2
    reference = bundle_model(make_tiny_llama(), make_word_tokenizer())
    assert loaded.fingerprint == reference.fingerprint


@pytest.mark.slow
def test_fingerprint_is_the_same_in_processes_with_other_hash_seeds(tmp_path: Path) -> None:
    directory = make_saved_tiny_model(tmp_path)
    script = (
        "import sys\n"
        "from kvsplice.client.model.models import ModelConfig, load_model\n"
        "print(load_model(ModelConfig(source=sys.argv[1])).fingerprint)\n"
    )
    seen = {load_model(ModelConfig(source=str(directory))).fingerprint}
    for seed in ("1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script, str(directory)], env=env, check=True,
            capture_output=True, text=True,
        )  # fmt: skip
        seen.add(out.stdout.strip().splitlines()[-1])
    assert len(seen) == 1


def test_publish_keeps_a_concurrently_converted_copy(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    for name in ("config.json", "tokenizer_config.json", "model.safetensors"):
        (target / name).write_text("{}")
    loser = tmp_path / ".model.tmp"
    loser.mkdir()
    (loser / "config.json").write_text('{"loser": true}')
    models._publish(loser, target)
    assert (target / "config.json").read_text() == "{}"


def test_publish_refuses_to_keep_a_partial_copy(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("{}")  # no tokenizer, no weights: not whole
    loser = tmp_path / ".model.tmp"
    loser.mkdir()
    (loser / "config.json").write_text('{"loser": true}')
    with pytest.raises(OSError):
        models._publish(loser, target)


def test_publish_renames_into_place(tmp_path: Path) -> None:
    tmp = tmp_path / ".model.tmp"
    tmp.mkdir()
    (tmp / "config.json").write_text("{}")
    models._publish(tmp, tmp_path / "model")
    assert (tmp_path / "model" / "config.json").is_file() and not tmp.exists()


@pytest.mark.slow
def test_smollm2_loads_with_the_design_geometry(smollm2: LoadedModel) -> None:
    assert smollm2.layout == KVLayout(30, 3, 64, 576, "float32")
    assert smollm2.rope.to_dict()["tables"][0]["params"]["rope_theta"] == 100000.0
    assert smollm2.model.config._attn_implementation == "sdpa"
    assert is_fingerprint(smollm2.fingerprint)


@pytest.mark.slow
def test_smollm2_conversion_is_reused_not_redone(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "_convert_gguf", refuse)
    cached = models.converted_smollm2_dir(ModelConfig().cache_dir.expanduser())
    assert (cached / "model.safetensors").is_file()
