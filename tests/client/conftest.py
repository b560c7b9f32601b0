"""Client-test fixtures: one SmolLM2 and one Qwen2 per test session (the 2-core box loads each once)."""

from __future__ import annotations

import pytest

from kvsplice.client.model.models import (
    LoadedModel,
    ModelConfig,
    load_model_cached,
)
from kvsplice.client.model.packaged_models import QWEN_CODER_05B_MODEL


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The bundled SmolLM2-135M-Instruct in fp32 (converted once into ~/.cache)."""
    return load_model_cached(ModelConfig())


@pytest.fixture(scope="session")
def qwen2_fp32() -> LoadedModel:
    """Qwen2.5-Coder-0.5B-Instruct in fp32 (`make test` installs it first via `make qwen`;
    run directly, a missing model fails the test rather than skipping it)."""
    return load_qwen2("float32")


@pytest.fixture(scope="session")
def qwen2_bf16() -> LoadedModel:
    """Qwen2.5-Coder-0.5B-Instruct in bf16, as the CLI loads it by default."""
    return load_qwen2("bfloat16")


def load_qwen2(dtype: str) -> LoadedModel:
    if not QWEN_CODER_05B_MODEL.is_installed():
        pytest.fail(
            f"{QWEN_CODER_05B_MODEL.name} not installed: {QWEN_CODER_05B_MODEL.install_hint}"
        )
    return load_model_cached(ModelConfig(QWEN_CODER_05B_MODEL.name, dtype=dtype))
