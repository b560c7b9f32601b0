"""`ModelConfig`: which model the worker loads and how, importable without torch.

Loading it is `models`'; the CLI and the bench configs name it without loading anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvsplice.client.model.packaged_models import PACKAGED_MODELS, SMOLLM2_MODEL
from kvsplice.common.layout import KV_DTYPES

SMOLLM2 = SMOLLM2_MODEL.name
DEFAULT_CACHE_DIR = Path("~/.cache/kvsplice/models")
# Both keep exact-splice logits within 1e-4 of dense in fp32 (measured on
# SmolLM2: max |Δ| 3.6e-5 eager, 3.2e-5 sdpa); SDPA is the default because it
# is the faster dense baseline, so reuse speedups are not flattered.
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how: `source` is a `PACKAGED_MODELS` name or a local HF directory."""

    source: str = SMOLLM2
    cache_dir: Path = DEFAULT_CACHE_DIR
    dtype: str = "float32"
    device: str = "cpu"
    attn_implementation: str = "sdpa"

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        if self.source not in PACKAGED_MODELS and not Path(self.source).expanduser().is_dir():
            raise ValueError(
                f"source {self.source!r} is neither one of {sorted(PACKAGED_MODELS)} "
                "nor a directory"
            )
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {KV_DTYPES}")
        if not self.device:
            raise ValueError("device must be non-empty")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation {self.attn_implementation!r} not in {ATTN_IMPLEMENTATIONS}"
            )
