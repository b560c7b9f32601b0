"""A call's execution after prefill: the cache, the first token's logits, what was generated.

Owns `GenerationConfig` (how far greedy decoding goes), `ExecutionState` (what
the executor hands back and keeps growing) and `content_tokens`. Running
anything is the executor's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvsplice.client.execute.layerwise_result import LayerwiseResult
from kvsplice.client.execute.reuse_map import ReuseMap

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationConfig:
    """Greedy decoding limits: stop after `max_new_tokens` or at a stop token.

    `ignore_stop` generates exactly `max_new_tokens` (fixed-shape benchmarks).
    `forced_ids` (teacher forcing): the answer is these tokens, as if generated;
    nothing is decoded, and storing reads their K/V as it would a generated answer's.
    """

    max_new_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_stop: bool = False
    forced_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} must be >= 1")
        if self.forced_ids and len(self.forced_ids) > self.max_new_tokens:
            raise ValueError(
                f"{len(self.forced_ids)} forced tokens exceed max_new_tokens {self.max_new_tokens}"
            )


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
