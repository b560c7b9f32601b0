"""What every vLLM test folder shares: the served model's directory."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def model_dir() -> str:
    """SmolLM2 converted to safetensors (KVSPLICE_VLLM_MODEL_DIR, else converted on first use)."""
    explicit = os.environ.get("KVSPLICE_VLLM_MODEL_DIR")
    if explicit:
        return explicit
    from kvsplice.client.model.models import DEFAULT_CACHE_DIR, converted_smollm2_dir

    return str(converted_smollm2_dir(DEFAULT_CACHE_DIR.expanduser()))
