"""How a generated token is picked from a step's logits: greedy, or sampled with a seed.

Owns `TokenPicker` only; when decoding stops is `GenerationConfig`'s, running the
model the executor's. Greedy is an argmax on the logits as they are (the oracle
tests' path); sampling draws on the CPU from a generator seeded once per call.
"""

from __future__ import annotations

import logging

import torch

from kvsplice.client.execute.execution import GenerationConfig

logger = logging.getLogger(__name__)


class TokenPicker:
    """Picks the tokens of one call under `config` (a sampling picker holds its generator)."""

    def __init__(self, config: GenerationConfig) -> None:
        self.samples = config.temperature > 0
        self._temperature = config.temperature
        self._top_p = config.top_p
        self._generator = torch.Generator(device="cpu")
        if config.seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(config.seed)

    def pick(self, logits: torch.Tensor) -> int:
        """A token id from `logits` [V]: the argmax, or a draw from the tempered nucleus."""
        if not self.samples:
            return int(torch.argmax(logits))
        probs = nucleus(
            torch.softmax(logits.float().cpu() / self._temperature, dim=-1), self._top_p
        )
        return int(torch.multinomial(probs, 1, generator=self._generator))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` [V] restricted to the most likely tokens whose mass first reaches `top_p`
    (always at least the most likely one), unnormalized (multinomial normalizes)."""
    if top_p >= 1.0:
        return probs
    ordered, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(ordered, dim=0) - ordered
    kept = torch.zeros_like(probs)
    keep = mass_before < top_p
    kept[order[keep]] = ordered[keep]
    return kept
