"""Oracles for KVComm's anchor gate (notes §6 test 8): hand-built pools, entropy in bits, top-p."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers.modes import SYNTH_ROPE, make_filled_segment, make_ids, make_llama, make_scene
from helpers.modes import one_torch_thread as one_torch_thread  # autouse fixture

from kvsplice.kvmath.anchor_gate import GateDecision, decide, entropy_bits, top_p_ids
from kvsplice.kvmath.anchors import AgentOffsets, Anchor
from kvsplice.kvmath.segment_kv import SegmentKV

AGENT = "agent-1"
QUERY = make_filled_segment([0.0, 0.0])


def make_anchor(anchor_id: str, base: SegmentKV | list[float], agent: str = AGENT) -> Anchor:
    base = base if isinstance(base, SegmentKV) else make_filled_segment(base)
    offsets = AgentOffsets(make_filled_segment([0.0] * base.num_tokens))
    return Anchor(anchor_id, base, {agent: offsets})


def gate(
    pool: list[Anchor], query: SegmentKV = QUERY, agent: str | None = None, **config: Any
) -> GateDecision:
    return decide(query, pool, SYNTH_ROPE, agent, **config)


def bits(weights: list[float]) -> float:
    return -sum(w * math.log2(w) for w in weights if w > 0)


@pytest.mark.parametrize("size", [0, 1])
def test_a_pool_of_at_most_one_anchor_goes_dense(size: int) -> None:
    decision = gate([make_anchor("a", [0.0, 0.0])][:size])
    assert (decision.reuse, decision.reason) == (False, "pool_too_small")


def test_anchors_shorter_than_the_sample_do_not_count() -> None:
    pool = [
        make_anchor("long", [1.0, 1.0, 1.0]),
        make_anchor("s1", [1.0]),
        make_anchor("s2", [0.0]),
    ]
    decision = gate(pool)
    assert (decision.reuse, decision.reason, decision.anchor_ids) == (
        False,
        "too_few_eligible",
        ("long",),
    )


def test_anchors_without_offsets_for_the_agent_do_not_count() -> None:
    pool = [make_anchor("mine", [1.0, 1.0]), make_anchor("theirs", [3.0, 3.0], agent="agent-2")]
    assert gate(pool).reason != "too_few_eligible"
    assert gate(pool, agent=AGENT).reason == "too_few_eligible"


def test_entropy_is_in_bits_and_compared_with_gamma_log2_of_the_eligible_count() -> None:
    """RMS distances 1 and 3 over their median 2, τ = 1: w = softmax(−0.5, −1.5), H = 0.84 bits."""
    pool = [make_anchor("a", [1.0, 1.0]), make_anchor("b", [3.0, 3.0])]
    weights = [1 / (1 + math.exp(-1.0)), 1 / (1 + math.exp(1.0))]
    lenient = gate(pool, gamma=1.0, tau=1.0)
    assert math.isclose(lenient.entropy_bits, bits(weights), rel_tol=1e-6)
    assert lenient.weights == pytest.approx(weights)
    assert (lenient.reuse, lenient.reason, lenient.threshold_bits) == (True, "confident", 1.0)
    strict = gate(pool, gamma=0.3, tau=1.0)
    assert (strict.reuse, strict.reason) == (False, "ambiguous")
    assert math.isclose(strict.threshold_bits, 0.3)


def test_equidistant_anchors_are_ambiguous() -> None:
    decision = gate([make_anchor(f"a{i}", [2.0, 2.0]) for i in range(4)], gamma=0.9)
    assert decision.weights == pytest.approx([0.25] * 4)
    assert math.isclose(decision.entropy_bits, 2.0)
    assert (decision.reuse, decision.reason, decision.activated_ids) == (False, "ambiguous", ())


def test_an_exact_match_is_confident_and_activates_only_itself() -> None:
    pool = [
        make_anchor("far", [4.0, 4.0]),
        make_anchor("same", [0.0, 0.0, 9.0]),
        make_anchor("mid", [1.0, 1.0]),
    ]
    decision = gate(pool)
    assert decision.weights == (0.0, 1.0, 0.0)
    assert (decision.reuse, decision.entropy_bits, decision.activated_ids) == (True, 0.0, ("same",))


def test_top_p_takes_the_heaviest_ids_until_the_mass_is_reached() -> None:
    ids, weights = ("a", "b", "c", "d"), torch.tensor([0.1, 0.6, 0.25, 0.05])
    assert top_p_ids(ids, weights, 0.9) == ("b", "c", "a")
    assert top_p_ids(ids, weights, 0.5) == ("b",)
    assert top_p_ids(ids, weights, 1.0) == ("b", "c", "a", "d")
    assert entropy_bits(torch.tensor([0.5, 0.5, 0.0])) == 1.0


def test_value_and_key_metrics_compare_different_tensors() -> None:
    """'v' matches the query's values only, 'k' its keys only: each metric picks its own."""
    query = make_filled_segment([1.0, 2.0])
    values_only = SegmentKV(query.keys + 5.0, query.values.clone(), 0)
    keys_only = SegmentKV(query.keys.clone(), query.values + 5.0, 0)
    pool = [make_anchor("v", values_only), make_anchor("k", keys_only)]
    assert gate(pool, query, metric="value").activated_ids == ("v",)
    assert gate(pool, query, metric="key").activated_ids == ("k",)


def test_key_metric_aligns_anchor_keys_to_the_query_positions() -> None:
    """An anchor prefilled at position 3 with the query's own keys is an exact key match."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 2, 2, 4, generator=generator)
    query = SegmentKV(keys, torch.zeros_like(keys), 0)
    moved = SegmentKV(SYNTH_ROPE.shift_layers(keys, 3), torch.zeros_like(keys), 3)
    pool = [make_anchor("moved", moved), make_anchor("other", SegmentKV(keys + 1.0, keys, 0))]
    assert gate(pool, query, metric="key").activated_ids == ("moved",)


def test_hidden_metric_reads_boundary_states() -> None:
    def with_hidden(fill: float) -> SegmentKV:
        segment = make_filled_segment([0.0, 0.0])
        segment.boundary_states[2] = torch.full((2, 8), fill)
        return segment

    pool = [make_anchor("near", with_hidden(1.0)), make_anchor("same", with_hidden(0.5))]
    assert gate(pool, with_hidden(0.5), metric="hidden", hidden_layer=2).activated_ids == ("same",)
    with pytest.raises(ValueError, match="boundary_states"):
        gate(pool, with_hidden(0.5), metric="hidden", hidden_layer=1)


@pytest.mark.parametrize(
    "bad", [{"gamma": 1.5}, {"metric": "embedding"}, {"top_p": 0.0}, {"metric": "hidden"}]
)  # fmt: skip
def test_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        gate([], **bad)


def test_on_a_tiny_llama_a_known_question_reuses_and_a_fresh_one_goes_dense() -> None:
    scene = make_scene(make_llama())
    questions = [make_ids(8 + k, 100 + k) for k in range(4)]
    pool = [scene.anchor(f"a{k}", q) for k, q in enumerate(questions)]
    known = decide(scene.base(questions[0]), pool, scene.rope, agent_id=scene.agent_id)
    assert (known.reuse, known.activated_ids) == (True, ("a0",))
    fresh = decide(scene.base(make_ids(8, 999)), pool, scene.rope, agent_id=scene.agent_id)
    # measured: weights (0.10, 0.22, 0.05, 0.63), H = 1.46 bits > 0.3 · log2 4 = 0.6
    assert (fresh.reuse, fresh.reason) == (False, "ambiguous")
