"""A call's execution after prefill: the cache, the first token's logits, what was generated.

Owns `GenerationConfig` (how far decoding goes, how tokens are picked), `ExecutionState` (what
the executor hands back and keeps growing) and `content_tokens`. Running
anything is the executor's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache

from kvsplice.client.execute.layerwise_executor import LayerwiseResult
from kvsplice.client.execute.reuse_map import ReuseMap

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationConfig:
    """How far decoding goes and how its tokens are picked.

    Stops after `max_new_tokens`, at a token of `stop_token_ids`, or, with
    `stop_at_eos` (the default), at the model's `eos_token_id` (the engine adds it:
    `with_eos`). `ignore_stop` generates exactly `max_new_tokens` (fixed-shape
    benchmarks). `forced_ids` (teacher forcing): the answer is these tokens, as if
    generated; nothing is decoded, and storing reads their K/V as it would a generated
    answer's. Greedy by default (`temperature` 0: the oracle tests' path); `temperature`
    > 0 samples from softmax(logits / temperature) cut to the nucleus of mass `top_p`,
    with a generator seeded by `seed` for each call (None: unseeded, not reproducible).
    """

    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_stop: bool = False
    forced_ids: tuple[int, ...] = ()
    stop_at_eos: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} must be >= 1")
        object.__setattr__(self, "stop_token_ids", token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "forced_ids", token_ids("forced_ids", self.forced_ids))
        if self.forced_ids and len(self.forced_ids) > self.max_new_tokens:
            raise ValueError(
                f"{len(self.forced_ids)} forced tokens exceed max_new_tokens {self.max_new_tokens}"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature {self.temperature!r} must be finite and >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p!r} must be in (0, 1]")
        if self.seed is not None and not (_is_id(self.seed) and self.seed < 1 << 63):
            raise ValueError(f"seed {self.seed!r} must be None or an int in [0, 2**63)")

    def with_eos(self, eos_token_ids: Sequence[int]) -> GenerationConfig:
        """This config with the model's `eos_token_ids` among its stop ids (`stop_at_eos`)."""
        if not self.stop_at_eos or self.ignore_stop:
            return self
        new = tuple(
            t for t in token_ids("eos_token_ids", eos_token_ids) if t not in self.stop_token_ids
        )
        return replace(self, stop_token_ids=self.stop_token_ids + new) if new else self


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def token_ids(name: str, ids: Sequence[int]) -> tuple[int, ...]:
    """`ids` as a tuple of token ids (ints >= 0); a ValueError names the first that is not."""
    if isinstance(ids, str | bytes):
        raise ValueError(f"{name} must be token ids, not the string {ids!r}")
    values = tuple(ids)
    bad = next((t for t in values if not _is_id(t)), None)
    if bad is not None:
        raise ValueError(f"{name}: {bad!r} is not a token id (an int >= 0)")
    return values


@dataclass
class ExecutionState:
    """The cache after a plan's prefill and what generation has added since.

    `reuse`: what the prefill reused per prompt range. `cache` holds K/V for
    positions [0, num_cached); `generated` are the greedy tokens so far (the
    newest one is not in the cache until it is fed). `layerwise`: the
    decoder-layer run that built the cache, with its captured states (None: the
    splice path).
    """

    reuse: ReuseMap
    cache: DynamicCache
    logits_first: torch.Tensor  # [V] float32, the last prompt token's logits
    generated: list[int] = field(default_factory=list)
    num_cached: int = 0
    layerwise: LayerwiseResult | None = None

    @property
    def prompt_len(self) -> int:
        return self.reuse.num_tokens


def content_tokens(generated: Sequence[int], config: GenerationConfig) -> tuple[int, ...]:
    """The generated tokens without a trailing stop token (what downstream agents see)."""
    if generated and not config.ignore_stop and generated[-1] in config.stop_token_ids:
        return tuple(generated[:-1])
    return tuple(generated)
