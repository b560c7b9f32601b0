"""Oracles for the KVComm offset correction (notes §6 test 7) on synthetic tensors and a tiny Llama."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.modes import (
    ATOL,
    SYNTH_DIM,
    SYNTH_HEADS,
    SYNTH_LAYERS,
    SYNTH_ROPE,
    AgentScene,
    dense_logits,
    make_filled_segment,
    make_ids,
    make_llama,
    make_scene,
    plan_with,
)
from helpers.modes import one_torch_thread as one_torch_thread  # autouse fixture

from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.modes.anchor.spans import anchor_spans
from kvsplice.kvmath.anchor_correction import AnchorCorrection, AnchorQuery, correct
from kvsplice.kvmath.anchors import AgentOffsets, Anchor, eligible_anchors
from kvsplice.kvmath.segment_kv import SegmentKV

LAYERS, HEADS, DIM = SYNTH_LAYERS, SYNTH_HEADS, SYNTH_DIM
ROPE = SYNTH_ROPE
AGENT = "agent-1"
make_segment = make_filled_segment


def make_anchor(
    anchor_id: str, base: list[float], offset: float, next_offset: float = 0.0
) -> Anchor:
    offsets = AgentOffsets(make_segment([offset] * len(base)), make_segment([next_offset] * 2))
    return Anchor(anchor_id, make_segment(base), {AGENT: offsets})


def softmax(logits: list[float]) -> list[float]:
    exps = [math.exp(x) for x in logits]
    return [e / sum(exps) for e in exps]


def test_two_synthetic_anchors_get_hand_computed_softmax_weights() -> None:
    """Per token: RMS distances (1, 3) and (2, 1), each over its median (the mean of two), τ = 1."""
    anchors = [make_anchor("a", [1.0, 2.0], 10.0, 100.0), make_anchor("b", [3.0, 1.0], 20.0, 200.0)]
    query = AnchorQuery(
        AGENT, make_segment([0.0, 0.0]), position=0, next_base=make_segment([0.0, 0.0])
    )
    result = correct(query, anchors, ROPE, tau=1.0)
    per_token = [softmax([-1 / 2, -3 / 2]), softmax([-4 / 3, -2 / 3])]
    expected = torch.tensor(per_token).T  # [A, T]
    torch.testing.assert_close(result.placeholder_weights.values, expected)
    torch.testing.assert_close(result.placeholder_weights.keys, expected)
    whole = [math.sqrt(2.5), math.sqrt(5.0)]
    expected_next = torch.tensor(softmax([-d / (sum(whole) / 2) for d in whole]))
    torch.testing.assert_close(result.next_weights.values, expected_next)
    for t in range(2):
        correction = 10.0 * expected[0, t] + 20.0 * expected[1, t]
        torch.testing.assert_close(
            result.placeholder.values[1:, :, t],
            torch.full((LAYERS - 1, HEADS, DIM), float(correction)),
        )
    next_correction = float(100.0 * expected_next[0] + 200.0 * expected_next[1])
    torch.testing.assert_close(
        result.next_text.values[1:], torch.full((LAYERS - 1, HEADS, 2, DIM), next_correction)
    )
    assert torch.equal(
        result.placeholder.values[0], torch.zeros(HEADS, 2, DIM)
    )  # layer 0 stays the base
    assert torch.equal(result.next_text.keys[0], torch.zeros(HEADS, 2, DIM))


def test_an_exact_base_match_takes_all_the_weight_of_its_tokens() -> None:
    """Anchor "b" shares the query's first token exactly: that token is one-hot on "b"."""
    anchors = [make_anchor("a", [1.0, 2.0, 5.0], 10.0), make_anchor("b", [0.5, 1.0, 5.0], 20.0)]
    query = AnchorQuery(AGENT, make_segment([0.5, 3.0]), position=0)
    weights = correct(query, anchors, ROPE).placeholder_weights.values
    assert weights[:, 0].tolist() == [0.0, 1.0]
    assert 0 < weights[0, 1] < 1


def test_offsets_move_with_the_query_position() -> None:
    """An offset made at position 5, used at position 9: keys rotate by Δ = 4 (R(Δ) is linear)."""
    base = make_segment([1.0, 1.0])
    offset = make_segment([0.3, -0.7], start=5)
    anchor = Anchor("a", base, {AGENT: AgentOffsets(offset)})
    result = correct(AnchorQuery(AGENT, base, position=9), [anchor], ROPE)
    expected = ROPE.shift_layers(base.keys, 9) + ROPE.shift_layers(offset.keys, 4)
    torch.testing.assert_close(result.placeholder.keys[1:], expected[1:])
    torch.testing.assert_close(result.placeholder.keys[0], ROPE.shift(base.keys[0], 9))
    assert result.placeholder.start_position == 9


def test_shorter_anchors_and_other_agents_anchors_are_not_eligible() -> None:
    long_enough = make_anchor("long", [1.0, 1.0, 1.0], 1.0)
    short = make_anchor("short", [1.0], 1.0)
    elsewhere = Anchor(
        "other-agent", make_segment([1.0, 1.0]), {"agent-2": long_enough.offsets(AGENT)}
    )
    pool = [long_enough, short, elsewhere]
    assert [a.anchor_id for a in eligible_anchors(pool, 2)] == ["long", "other-agent"]
    assert [a.anchor_id for a in eligible_anchors(pool, 2, AGENT)] == ["long"]
    query = AnchorQuery(AGENT, make_segment([0.0, 0.0]), position=0)
    for bad in (short, elsewhere):
        with pytest.raises(ValueError, match="not eligible"):
            correct(query, [long_enough, bad], ROPE)


def test_each_agent_gets_its_own_offsets() -> None:
    base = make_segment([1.0, 2.0])
    anchor = Anchor("a", base, {
        "agent-1": AgentOffsets(make_segment([1.0, 1.0])),
        "agent-2": AgentOffsets(make_segment([-4.0, -4.0])),
    })  # fmt: skip
    for agent, offset in (("agent-1", 1.0), ("agent-2", -4.0)):
        result = correct(AnchorQuery(agent, base, position=0), [anchor], ROPE)
        torch.testing.assert_close(result.placeholder.values[1:], base.values[1:] + offset)


def scene_question(seed: int, num_tokens: int = 8) -> tuple[int, ...]:
    return make_ids(num_tokens, seed)


def pool_for(scene: AgentScene) -> tuple[list[Anchor], list[tuple[int, ...]]]:
    questions = [scene_question(100 + k, 8 + k) for k in range(3)]
    return [scene.anchor(f"a{k}", q) for k, q in enumerate(questions)], questions


def test_query_equal_to_an_anchor_reproduces_its_real_kv_and_dense_logits() -> None:
    """Same base → one-hot on that anchor → approx = its real K/V (layers ≥ 1; layer 0 = shifted base)."""
    scene = make_scene(make_llama())
    anchors, questions = pool_for(scene)
    question = questions[0]  # 8 tokens: every anchor (8, 9, 10 tokens) is eligible
    position = len(scene.head)
    query = AnchorQuery(scene.agent_id, scene.base(question), position, scene.next_base())
    result = correct(query, anchors, scene.rope)
    one_hot = torch.tensor([1.0, 0.0, 0.0])
    for weights in (result.placeholder_weights.keys, result.placeholder_weights.values):
        assert torch.equal(weights, one_hot.unsqueeze(1).expand(3, len(question)))
    assert torch.equal(result.next_weights.keys, one_hot)
    real_question, real_next = scene.real(question)
    for approx, real in ((result.placeholder, real_question), (result.next_text, real_next)):
        torch.testing.assert_close(approx.keys[1:], real.keys[1:], atol=1e-5, rtol=0)
        torch.testing.assert_close(approx.values[1:], real.values[1:], atol=1e-5, rtol=0)
    base_layer0 = scene.rope.shift(query.base.keys[0], position)
    assert torch.equal(result.placeholder.keys[0], base_layer0)
    torch.testing.assert_close(base_layer0, real_question.keys[0], atol=1e-5, rtol=0)
    ids = scene.prompt(question)
    logits = LayerwiseExecutor(scene.model).run(plan_with(ids, *anchor_spans(result))).logits_last
    torch.testing.assert_close(logits, dense_logits(scene.model, ids), atol=ATOL, rtol=0)


def test_the_setting_discriminates_uncorrected_reuse_from_dense() -> None:
    """The oracle above is not trivially met: the same spans without correction are far from dense."""
    scene = make_scene(make_llama())
    question = pool_for(scene)[1][0]
    position, ids = len(scene.head), scene.prompt(question)
    naive = anchor_spans(_uncorrected(scene, question, position))
    logits = LayerwiseExecutor(scene.model).run(plan_with(ids, *naive)).logits_last
    # measured: 0.137 (naive) vs 1.8e-7 (anchor, one-hot)
    assert (logits - dense_logits(scene.model, ids)).abs().max() > 1000 * ATOL


def _uncorrected(scene: AgentScene, question: tuple[int, ...], position: int) -> AnchorCorrection:
    """A correction with zero offsets: shifted base K/V only (naive reuse)."""
    base, next_base = scene.base(question), scene.next_base()
    zero = AgentOffsets(
        SegmentKV(torch.zeros_like(base.keys), torch.zeros_like(base.values), position),
        SegmentKV(torch.zeros_like(next_base.keys), torch.zeros_like(next_base.values), 0),
    )
    anchor = Anchor("zero", base, {scene.agent_id: zero})
    return correct(AnchorQuery(scene.agent_id, base, position, next_base), [anchor], scene.rope)
