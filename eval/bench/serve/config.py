"""`ServeBenchConfig`: the grid `bench serve` runs (configurations, workloads, concurrencies).

Owns the grid's names and its checks; the engines, router and clients are `bench`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvsplice.eval.bench.serve.workloads import WORKLOADS, WorkloadShape

CONFIGS = ("recompute", "local-apc", "lmcache", "kvsplice")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ServeBenchConfig:
    """The whole grid: configurations x workloads x concurrencies x repeats.

    A run at concurrency c sends `num_prompts` x max(1, c // 4) requests (multi_turn: that
    many turns, rounded up to whole conversations of `shape.user_turns`).
    """

    model_dir: str
    out_json: Path
    work_dir: Path
    benchmarks_dir: Path  # vLLM's sdist `benchmarks/` (the multi-turn client)
    configs: tuple[str, ...] = CONFIGS
    workloads: tuple[str, ...] = WORKLOADS
    concurrencies: tuple[int, ...] = (1, 4, 16)
    num_prompts: int = 16
    repeats: int = 1
    dtype: str = "float32"
    threads: str = "0-1"
    chunk_tokens: int = 256  # kvsplice's chunk and LMCache's alike
    seed: int = 0
    shape: WorkloadShape = field(default_factory=WorkloadShape)

    def __post_init__(self) -> None:
        for name, chosen, known in (("configs", self.configs, CONFIGS),
                                    ("workloads", self.workloads, WORKLOADS)):  # fmt: skip
            if not chosen or not set(chosen) <= set(known) or len(set(chosen)) < len(chosen):
                raise ValueError(f"{name} {chosen}: some of {known}, each once")
        if not self.concurrencies or any(not 1 <= c <= 256 for c in self.concurrencies):
            raise ValueError(f"concurrencies {self.concurrencies} not all in [1, 256]")
        if self.num_prompts < 1 or self.num_prompts % self.shape.num_prefixes:
            raise ValueError(f"num_prompts {self.num_prompts} is not a positive multiple of "
                             f"{self.shape.num_prefixes} (prefix_repetition's prefixes)")  # fmt: skip
        if not 1 <= self.repeats <= 20:
            raise ValueError(f"repeats {self.repeats} not in [1, 20]")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {DTYPES}")
        if self.chunk_tokens < 16 or self.chunk_tokens % 16:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} is not a positive multiple of 16")

    def num_requests(self, concurrency: int) -> int:
        return self.num_prompts * max(1, concurrency // 4)
