"""The judge routes' cost model and the routing rule, by hand-computed oracles."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.client.modes.route_cost import (
    CostModel,
    JudgeShape,
    cheapest_route,
    dense_cost,
    exact_cost,
    staged_cost,
)

# compute 1 s per token·layer and nothing else: every price is a token·layer count
COMPUTE_ONLY = CostModel(1.0, 0.0, 0.0, 0.0, 0.0)
# 10 layers; 100 tokens: 20 stored prefix, answers [30, 90) of which 50 answer tokens
SHAPE = JudgeShape(num_tokens=100, num_layers=10, prefix_hit=20, first_answer=30, answer_tokens=50)


def test_dense_and_exact_count_what_they_compute_and_read() -> None:
    cost = CostModel(1.0, 0.1, 5.0, 7.0, 3.0)
    assert dense_cost(SHAPE, cost) == pytest.approx(100 * 10 + 7.0)
    # 80 tokens computed, 20 read, one pass, one lookup
    assert exact_cost(SHAPE, cost) == pytest.approx(80 * 10 + 0.1 * 20 * 10 + 5.0 + 3.0)


def test_a_kept_first_pass_costs_only_itself() -> None:
    # suffix 70 tokens from the first answer, 20 of them text; check 4: layers 0..4 for the
    # suffix, 5..9 for the text; the 10 tokens between prefix and first answer: all layers
    expected = 10 * 10 + 70 * 5 + 20 * 5
    assert staged_cost(SHAPE, COMPUTE_ONLY, (4,), (1.0,)) == pytest.approx(expected)


def test_a_ratio_keeps_its_share_of_the_answers_computed_above_the_check() -> None:
    # ratio 0.4: 20 text tokens and 0.4 x 50 answer tokens through layers 5..9
    expected = 10 * 10 + 70 * 5 + (20 + 20) * 5
    assert staged_cost(SHAPE, COMPUTE_ONLY, (4,), (1.0,), ratio=0.4) == pytest.approx(expected)
    # ratio 1 computes everything: dense's work
    assert staged_cost(SHAPE, COMPUTE_ONLY, (4,), (1.0,), ratio=1.0) == pytest.approx(
        10 * 10 + 70 * 10
    )
    with pytest.raises(ValueError, match="ratio"):
        staged_cost(SHAPE, COMPUTE_ONLY, (4,), (1.0,), ratio=1.5)


def test_passes_a_call_reaches_add_their_work_by_probability() -> None:
    first = 10 * 10 + 70 * 5 + 20 * 5
    second = 70 * (8 + 1 - 4) + 20 * 1  # resumes at layer 4, computes up to 8, text on
    tail = 70 * (10 - 8)
    got = staged_cost(SHAPE, COMPUTE_ONLY, (4, 8), (0.5, 0.25))
    assert got == pytest.approx(first + 0.5 * second + 0.5 * 0.75 * tail)


def test_a_never_kept_staged_route_is_dearer_than_dense() -> None:
    """Refused by every pass it computes dense's work plus the text it recomputed."""
    for checks in ((4,), (2, 8), (0,), (9,)):
        worst = staged_cost(SHAPE, COMPUTE_ONLY, checks, ())
        assert worst > dense_cost(SHAPE, COMPUTE_ONLY) - SHAPE.prefix_hit * 10


def test_the_rule_never_picks_a_route_dearer_than_dense() -> None:
    assert cheapest_route({"exact": 1.2, "crossfix": 1.1, "dense": 1.0}) == "dense"
    assert cheapest_route({"exact": 0.9, "crossfix": 0.5, "dense": 1.0}) == "crossfix"
    assert cheapest_route({"exact": 0.5, "crossfix": 0.5, "dense": 1.0}) == "exact"  # tie: first
    with pytest.raises(ValueError, match="dense"):
        cheapest_route({"exact": 0.5})


@given(st.dictionaries(st.sampled_from(["exact", "crossfix", "x"]), st.floats(0, 10)),
       st.floats(0, 10))  # fmt: skip
def test_the_rule_picks_the_minimum_at_or_below_dense(others: dict, dense: float) -> None:
    prices = {**others, "dense": dense}
    chosen = cheapest_route(prices)
    assert prices[chosen] <= dense
    assert prices[chosen] == min(prices.values())


def test_bad_constants_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="s_per_pass"):
        CostModel(1.0, 0.0, -1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="answer_tokens"):
        JudgeShape(num_tokens=10, num_layers=2, prefix_hit=0, first_answer=5, answer_tokens=6)
