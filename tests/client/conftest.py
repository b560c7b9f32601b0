"""Client-test fixtures: one SmolLM2 per test session (the 2-core box loads it once)."""

from __future__ import annotations

import pytest

from kvsplice.client.models import LoadedModel, ModelConfig, load_model_cached


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The bundled SmolLM2-135M-Instruct in fp32 (converted once into ~/.cache)."""
    return load_model_cached(ModelConfig())
