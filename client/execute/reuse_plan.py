"""The reuse plan: for each token range of a prompt, in order, where its K/V comes from.

Owns the plan data model only: a tagged union of span actions (`Compute`,
`Reuse`) and `ReusePlan`, which checks that the ranges tile the prompt. Later
modes add action types (a corrected reuse, a partial-layer reuse) beside these;
the executor dispatches on the type. Deciding a plan is a policy's job.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Compute:
    """Run the model over the range's tokens, attending to everything before them."""


@dataclass(frozen=True)
class Reuse:
    """Take the range's K/V from `segment`, moved to the range's start position.

    The keys are shifted by Δ = target_start − segment.start_position (Δ = 0 is
    a bit-exact copy). `mode` names the policy rule that chose it ("exact",
    "naive", ...); `exact` says whether the segment's whole left context equals
    the prompt's (then the result equals dense prefill up to summation order).
    `chain_key` is the stored segment's context key when it is exact, and
    `chain_num_tokens` how many prompt tokens that key covers from the span's
    start (more than the span's when the prompt's last token was cut off to be
    computed); recording uses them to continue the key chain.
    """

    segment: SegmentKV
    mode: str
    exact: bool
    chain_key: bytes | None = None
    chain_num_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.segment.num_tokens


SpanAction = Compute | Reuse


@dataclass(frozen=True)
class PlannedSpan:
    """Tokens `[start, end)` of the prompt, the action that provides their K/V, and a label."""

    start: int
    end: int
    action: SpanAction
    name: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(
                f"planned span {self.name!r} [{self.start}, {self.end}) is empty or negative"
            )
        if isinstance(self.action, Reuse) and self.action.num_tokens != self.num_tokens:
            raise ValueError(
                f"span {self.name!r} has {self.num_tokens} tokens but its segment "
                f"holds {self.action.num_tokens}"
            )

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def delta(self) -> int:
        """Δ = new − old position of a reused span (0 for computed spans)."""
        if isinstance(self.action, Reuse):
            return self.start - self.action.segment.start_position
        return 0


@dataclass(frozen=True)
class ReusePlan:
    """Spans tiling `token_ids` in order; the last prompt token is always computed."""

    token_ids: tuple[int, ...]
    spans: tuple[PlannedSpan, ...]

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a plan needs at least one prompt token")
        cursor = 0
        for span in self.spans:
            if span.start != cursor:
                raise ValueError(f"span {span.name!r} starts at {span.start}, expected {cursor}")
            cursor = span.end
        if cursor != len(self.token_ids):
            raise ValueError(f"plan covers {cursor} of {len(self.token_ids)} prompt tokens")
        if not isinstance(self.spans[-1].action, Compute):
            raise ValueError("the last prompt token must be computed (its logits are needed)")

    @classmethod
    def all_compute(cls, token_ids: Sequence[int], name: str = "prompt") -> ReusePlan:
        ids = tuple(int(t) for t in token_ids)
        return cls(ids, (PlannedSpan(0, len(ids), Compute(), name),))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_reused_tokens(self) -> int:
        return sum(s.num_tokens for s in self.spans if isinstance(s.action, Reuse))

    @property
    def reused_spans(self) -> tuple[PlannedSpan, ...]:
        return tuple(s for s in self.spans if isinstance(s.action, Reuse))
