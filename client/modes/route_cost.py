"""What a judge call's routes are predicted to cost, and the rule that picks one.

Owns `CostModel` (per-model constants that calibration measures), `JudgeShape` (the
token counts of one judge prompt that the routes' costs depend on), the per-route
predictions and `cheapest_route`. It runs nothing and measures nothing: timing the
constants is `eval.measure.route_costs`' job, routing is the gated policy's.

A route's predicted prefill time is linear in what it does:
    s_per_token_layer × token·layers computed + s_per_read_token_layer × token·layers
    read from the store (fetch + decode) + s_per_pass × layerwise passes (+ s_lookup
    for a route that reads the store; dense prefill is one plain forward: s_dense_fixed).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvsplice.common.reuse_modes import DENSE

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CostModel:
    """Seconds per unit of work on one model and machine (all measured, all >= 0)."""

    s_per_token_layer: float
    s_per_read_token_layer: float
    s_per_pass: float
    s_dense_fixed: float
    s_lookup: float

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} {value!r} must be finite and >= 0")


@dataclass(frozen=True)
class JudgeShape:
    """One judge prompt as the routes see it (token counts; `prefix_hit` from the store).

    num_tokens: the prompt; prefix_hit: tokens of its stored exact prefix; first_answer:
    where its first candidate block starts; answer_tokens: the candidate blocks' tokens
    after the exact prefix (what an interaction-preserving mode reads from the store).
    """

    num_tokens: int
    num_layers: int
    prefix_hit: int
    first_answer: int
    answer_tokens: int

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_tokens < 1:
            raise ValueError(f"judge shape {self} needs tokens and layers")
        if not 0 <= self.prefix_hit <= self.num_tokens:
            raise ValueError(f"prefix_hit {self.prefix_hit} outside the prompt")
        if not 0 <= self.first_answer <= self.num_tokens:
            raise ValueError(f"first_answer {self.first_answer} outside the prompt")
        if not 0 <= self.answer_tokens <= self.num_tokens - self.start:
            raise ValueError(f"answer_tokens {self.answer_tokens} exceed the suffix")

    @property
    def start(self) -> int:
        """First token an interaction-preserving pass may recompute (the first stale answer)."""
        return max(self.prefix_hit, self.first_answer)


def dense_cost(shape: JudgeShape, cost: CostModel) -> float:
    """Every token through every layer, one plain forward."""
    return cost.s_per_token_layer * shape.num_tokens * shape.num_layers + cost.s_dense_fixed


def exact_cost(shape: JudgeShape, cost: CostModel) -> float:
    """The stored exact prefix read, the rest computed through every layer."""
    layers = shape.num_layers
    computed = (shape.num_tokens - shape.prefix_hit) * layers
    read = shape.prefix_hit * layers
    return _work(cost, computed, read, passes=1)


def staged_cost(
    shape: JudgeShape,
    cost: CostModel,
    checks: Sequence[int],
    keep: Sequence[float],
    ratio: float = 0.0,
) -> float:
    """Expected time of `crossfix`'s passes: pass i recomputes every token from the first
    answer on up to its check layer `checks[i]` (the text between and after the answers,
    and the `ratio` share of answer tokens, on through every layer) and is kept with
    probability `keep[i]`; after the last pass, the rest is computed on from the last
    check layer (dense from there).

    `keep` may be shorter than `checks` (a missing rate is 0: never kept).
    """
    if not 0 <= ratio <= 1:
        raise ValueError(f"ratio {ratio} not in [0, 1]")
    layers, suffix = shape.num_layers, shape.num_tokens - shape.start
    text = suffix - shape.answer_tokens + ratio * shape.answer_tokens
    between = (shape.start - shape.prefix_hit) * layers  # computed once, exactly
    read = (shape.prefix_hit + shape.answer_tokens) * layers
    expected, reach, below = 0.0, 1.0, 0
    for index, check in enumerate(min(c, layers - 1) for c in checks):
        computed = suffix * (check + 1 - below) + text * (layers - check - 1)
        if index == 0:
            step = _work(cost, computed + between, read, passes=1)
        else:
            step = _work(cost, computed, 0, passes=1) - cost.s_lookup
        expected += reach * step
        reach *= 1 - (keep[index] if index < len(keep) else 0.0)
        below = check
    tail = _work(cost, suffix * (layers - below), 0, passes=1) - cost.s_lookup
    return expected + reach * tail


def _work(cost: CostModel, computed: float, read: float, passes: int) -> float:
    return (
        cost.s_per_token_layer * computed
        + cost.s_per_read_token_layer * read
        + cost.s_per_pass * passes
        + cost.s_lookup
    )


def cheapest_route(predicted_s: Mapping[str, float]) -> str:
    """The route predicted fastest among those predicted no slower than dense (dense when
    none is); a tie goes to the earlier route in `predicted_s`'s order (list the
    zero-drift routes first)."""
    if DENSE not in predicted_s:
        raise ValueError(f"no dense price among {sorted(predicted_s)}")
    ceiling = predicted_s[DENSE]
    affordable = [(s, i, m) for i, (m, s) in enumerate(predicted_s.items()) if s <= ceiling]
    return min(affordable)[2]
