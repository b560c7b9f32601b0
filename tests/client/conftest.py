"""Client-test fixtures: one SmolLM2 per test session (the 2-core box loads it once)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvsplice.client.model.models import LoadedModel, ModelConfig, load_model_cached
from kvsplice.client.store import store_faults


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """The bundled SmolLM2-135M-Instruct in fp32 (converted once into ~/.cache)."""
    return load_model_cached(ModelConfig())


@pytest.fixture(autouse=True)
def fresh_warning_rate_limits() -> Iterator[None]:
    """The degraded-store warning is rate-limited per target for the process; tests start clean."""
    store_faults._TARGET_TO_STATE.clear()
    yield
    store_faults._TARGET_TO_STATE.clear()
