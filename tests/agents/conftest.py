"""Agents-test fixtures: the SmolLM2 tokenizer and model, loaded once per session."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from kvsplice.client.model.models import (
    DEFAULT_CACHE_DIR,
    LoadedModel,
    ModelConfig,
    converted_smollm2_dir,
    load_model_cached,
)


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """The bundled SmolLM2 tokenizer (converting the GGUF once into ~/.cache if needed)."""
    return AutoTokenizer.from_pretrained(
        converted_smollm2_dir(DEFAULT_CACHE_DIR.expanduser()), local_files_only=True
    )


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The bundled SmolLM2-135M-Instruct in fp32."""
    return load_model_cached(ModelConfig())
