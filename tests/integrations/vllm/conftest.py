"""What every vLLM test folder shares: the served model's directory.

The folder runs where vLLM is installed: `make test` runs it in `.venv-vllm`. In a
virtualenv without vLLM (`.venv`) nothing here is collected, so modules that import
vLLM at the top (its event classes, its config) need no guard of their own.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*"]


@pytest.fixture(scope="session")
def model_dir() -> str:
    """SmolLM2 converted to safetensors (KVSPLICE_VLLM_MODEL_DIR, else converted on first use)."""
    explicit = os.environ.get("KVSPLICE_VLLM_MODEL_DIR")
    if explicit:
        return explicit
    from kvsplice.client.model.models import DEFAULT_CACHE_DIR, converted_smollm2_dir

    return str(converted_smollm2_dir(DEFAULT_CACHE_DIR.expanduser()))


@pytest.fixture(scope="module")
def adapters(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two LoRA adapters of the served model by name (random weights, fixed by their seeds)."""
    from helpers.lora_adapters import write_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {
        name: write_adapter(root / name, model_dir, seed)
        for name, seed in (("sql", 1), ("math", 2))
    }
