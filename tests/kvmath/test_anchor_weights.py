"""Invariants of anchor weights: a distribution, scale-free, permutation-equivariant, exact matches win."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.modes import one_torch_thread as one_torch_thread  # autouse fixture
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.kvmath.anchors import (
    anchor_weights,
    token_distances,
    whole_distances,
)

positive = st.floats(min_value=0.01, max_value=100.0)
distance_lists = st.lists(positive, min_size=1, max_size=8)


@settings(max_examples=50, deadline=None)
@given(distances=distance_lists, scale=st.floats(min_value=0.01, max_value=100.0))
def test_median_normalized_weights_are_a_scale_free_distribution(
    distances: list[float], scale: float
) -> None:
    d = torch.tensor(distances)
    weights = anchor_weights(d, 1.0)
    assert bool((weights >= 0).all()) and math.isclose(float(weights.sum()), 1.0, abs_tol=1e-5)
    torch.testing.assert_close(anchor_weights(d * scale, 1.0), weights)


@settings(max_examples=50, deadline=None)
@given(distances=distance_lists, seed=st.integers(0, 1000))
def test_weights_follow_the_anchors_when_permuted(distances: list[float], seed: int) -> None:
    d = torch.tensor(distances)
    perm = torch.randperm(len(distances), generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(
        anchor_weights(d[perm], 2.0, normalize="query_rms"),
        anchor_weights(d, 2.0, normalize="query_rms")[perm],
    )


@settings(max_examples=50, deadline=None)
@given(distances=st.lists(positive, min_size=2, max_size=8))
def test_a_closer_anchor_never_weighs_less(distances: list[float]) -> None:
    d = torch.tensor(distances)
    weights = anchor_weights(d, 1.0)
    order = torch.argsort(d)
    assert bool((weights[order][:-1] >= weights[order][1:] - 1e-6).all())


def test_query_rms_normalization_divides_by_the_query_scale() -> None:
    weights = anchor_weights(torch.tensor([1.0, 3.0]), 2.0, 0.5, normalize="query_rms")
    expected = torch.softmax(torch.tensor([-1.0, -3.0]), dim=0)  # d / 2 / 0.5
    torch.testing.assert_close(weights, expected)


def test_exact_matches_split_the_weight_and_win_per_column() -> None:
    distances = torch.tensor([[0.0, 1.0], [0.0, 2.0], [5.0, 3.0]])  # [A=3, T=2]
    weights = anchor_weights(distances, 1.0)
    assert weights[:, 0].tolist() == [0.5, 0.5, 0.0]
    assert math.isclose(float(weights[:, 1].sum()), 1.0, abs_tol=1e-6)
    assert 0 < float(weights[2, 1]) < float(weights[0, 1])


def test_distances_are_rms_over_features() -> None:
    query = torch.zeros(2, 4)
    anchors = torch.tensor([[[1.0] * 4, [3.0] * 4]])  # [A=1, T=2, F=4]
    assert token_distances(query, anchors).tolist() == [[1.0, 3.0]]
    torch.testing.assert_close(whole_distances(query, anchors), torch.tensor([math.sqrt(5.0)]))


@pytest.mark.parametrize(
    "bad", [{"tau": 0.0}, {"normalize": "max"}, {"exact_rtol": -1.0}]
)  # fmt: skip
def test_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        anchor_weights(torch.ones(2), 1.0, **bad)
