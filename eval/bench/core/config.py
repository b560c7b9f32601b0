"""`CoreBenchConfig` and the flags of `kvsplice bench core` beside its fields. Imports no torch:
the CLI derives `--help` from it; running it is `bench`'s (`run_core_bench`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvsplice.client.model.model_config import ModelConfig
from kvsplice.common.config_flags import flag


@dataclass(frozen=True)
class CoreBenchConfig:
    """Prompt `lengths` through `model`, timed at each of `thread_counts` torch threads, `repeats`
    runs each; `json_path`: where the CLI also writes the rows (None: nowhere)."""

    lengths: tuple[int, ...] = flag(
        (256, 1024, 2048), "Comma-separated prompt lengths.", csv=True, min=1
    )
    thread_counts: tuple[int, ...] = flag(
        (1, 2), "Comma-separated torch thread counts.", name="threads", csv=True, min=1
    )
    repeats: int = flag(5, "Timed runs per length.", min=1)
    json_path: Path | None = flag(  # noqa: RUF009 (`flag` makes a field, as `field` does)
        None, "Also write the rows as JSON.", name="json", path=True
    )
    model: ModelConfig = field(default_factory=ModelConfig)

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths {self.lengths} must be non-empty and positive")
        if not self.thread_counts or min(self.thread_counts) < 1:
            raise ValueError(f"thread_counts {self.thread_counts} must be non-empty and positive")
        if self.repeats < 1:
            raise ValueError(f"repeats {self.repeats} must be >= 1")
        if self.json_path is not None:
            object.__setattr__(self, "json_path", Path(self.json_path))
