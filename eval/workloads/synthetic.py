"""The synthetic TTFT workload with the shape of KVComm's Tables 2–3 (seed 002).

Owns seeded word salad of an exact token length and `SyntheticWorkload`: N
agents, each with its own `prefix_len`-token system prompt, all reading one
`input_len`-token user input per sample, every agent forced to generate
exactly `response_len` tokens (EOS ignored) that later agents read. The text
means nothing; only the prompt shape matters.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.agents.personas import Persona
from kvsplice.agents.render import Tokenizer
from kvsplice.agents.roles import MAX_AGENTS, MIN_AGENTS, AgentRole, make_roles
from kvsplice.eval.workloads.workload import Problem, Workload

logger = logging.getLogger(__name__)

# A fixed vocabulary; only words that are one token after a space are used, so
# n words are exactly n tokens whatever their order.
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their can has more will would "
    "time about if out up so what when them some other into than its two then only could "
    "first new people may like these over such no most after also made many did before must "
    "through back years where much your way well down should because each just those how "
    "work life being under never day same another know while last might great old year off "
    "come since against right take three state good world still own see men place house "
    "water city music river market garden window paper table light stone green bright quiet "
    "north south summer winter morning evening story letter number system question answer"
)
VOCABULARY = tuple(_WORDS.split())
MIN_VOCABULARY = 32
INSTRUCTION = "Continue the text."


def single_token_words(tokenizer: Tokenizer, words: Sequence[str] = VOCABULARY) -> tuple[str, ...]:
    """The words of `words` that `tokenizer` encodes as exactly one token after a space."""
    kept = tuple(w for w in words if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1)
    if len(kept) < MIN_VOCABULARY:
        raise ValueError(
            f"only {len(kept)} of {len(words)} words are single tokens for this tokenizer; "
            f"need {MIN_VOCABULARY}"
        )
    return kept


def word_salad(rng: random.Random, words: Sequence[str], num_tokens: int) -> str:
    """`num_tokens` words drawn with `rng`, each with a leading space (one token each)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens {num_tokens} must be >= 1")
    return "".join(" " + rng.choice(words) for _ in range(num_tokens))


@dataclass(frozen=True)
class SyntheticConfig:
    """Token lengths of each agent's system prompt, the shared user input and each response."""

    prefix_len: int = 512
    input_len: int = 512
    response_len: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefix_len", "input_len", "response_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class SyntheticWorkload(Workload):
    """Word-salad agents for TTFT measurement; nothing is scored."""

    name = "synthetic"
    ignore_stop = True  # every response is exactly `response_len` tokens

    def __init__(self, tokenizer: Tokenizer, config: SyntheticConfig | None = None) -> None:
        self.config = config or SyntheticConfig()
        self._tokenizer = tokenizer

    @functools.cached_property
    def words(self) -> tuple[str, ...]:
        return single_token_words(self._tokenizer)

    def problems(self, num_problems: int) -> list[Problem]:
        """Sample i's user input is seeded by (seed, i): the same run gives the same text."""
        return [
            Problem(
                f"synthetic-{i}",
                word_salad(self._rng("input", i), self.words, self.config.input_len),
            )
            for i in range(num_problems)
        ]

    def roles(self, num_agents: int, max_new_tokens: int) -> list[AgentRole]:
        """Agent k's system prompt is its own salad; every cap is `response_len`.

        `max_new_tokens` is ignored: the response length is part of the shape.
        """
        if not MIN_AGENTS <= num_agents <= MAX_AGENTS:
            raise ValueError(f"num_agents {num_agents} outside [{MIN_AGENTS}, {MAX_AGENTS}]")
        personas = [
            Persona(
                f"agent {k}",
                word_salad(self._rng("prefix", k), self.words, self.config.prefix_len),
                INSTRUCTION,
            )
            for k in range(1, num_agents + 1)
        ]
        return make_roles(personas, [self.config.response_len] * num_agents)

    def score(self, problem: Problem, answer_text: str) -> bool | None:
        return None

    def _rng(self, purpose: str, index: int) -> random.Random:
        return random.Random(f"{self.config.seed}:{purpose}:{index}")
