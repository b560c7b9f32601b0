"""JCR, selection reading and the mapping of display slots back to agents, under permutations."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.agents.judge import DisplayOrder
from kvsplice.client.modes.base import CandidateBlock
from kvsplice.client.reuse_engine import ReusedSpan
from kvsplice.eval.measure.jcr import JudgeRecord, call_route, candidate_token_layers, summarize
from kvsplice.eval.measure.judge_selection import (
    choice_token_ids,
    constrained_slot,
    parse_slot,
    read_selection,
)

AGENTS = ("1", "2", "3", "4")
CHOICE_IDS = (33, 34, 35, 36)  # the label tokens "1".."4" at the decision position


def logits_choosing(slot: int, vocab: int = 64) -> torch.Tensor:
    logits = torch.zeros(vocab)
    logits[list(CHOICE_IDS)] = torch.tensor([1.0, 2.0, 3.0, 4.0]) / 10
    logits[CHOICE_IDS[slot]] = 5.0
    logits[0] = 50.0  # a token outside the choice set never wins the constrained read
    return logits


def make_judge_record(**overrides: object) -> JudgeRecord:
    base = JudgeRecord(
        example_id="e0", task="gsm8k", mode="naive", order=AGENTS, agent_id="1", slot=0,
        margin=1.0, parsed_agent_id="1", dense_agent_id="1", dense_slot=0, dense_margin=1.0,
        dense_parsed_agent_id="1", ttft_s=0.5, dense_ttft_s=1.0, num_prompt_tokens=100,
        num_reused_tokens=40, num_candidate_tokens=40, num_candidate_token_layers_reused=600,
        num_layers=30,
    )  # fmt: skip
    return replace(base, **overrides)


permutations = st.permutations(AGENTS)


@given(permutations, st.integers(0, 3))
def test_constrained_read_maps_the_slot_to_the_agent_shown_there(order_ids, slot) -> None:
    order = DisplayOrder(tuple(order_ids))
    selection = read_selection(logits_choosing(slot), "", order, CHOICE_IDS)
    assert selection.slot == slot
    assert selection.agent_id == order_ids[slot]
    assert selection.margin == pytest.approx(5.0 - 0.4 if slot != 3 else 5.0 - 0.3)


@given(permutations, permutations, st.sampled_from(AGENTS))
def test_the_same_agent_chosen_under_two_orders_reads_as_the_same_agent(
    first, second, agent
) -> None:
    reads = []
    for ids in (first, second):
        order = DisplayOrder(tuple(ids))
        slot = ids.index(agent)
        reads.append(read_selection(logits_choosing(slot), "", order, CHOICE_IDS))
    assert reads[0].agent_id == reads[1].agent_id == agent


@given(permutations, st.integers(0, 3))
def test_the_text_is_read_as_a_display_label(order_ids, slot) -> None:
    order = DisplayOrder(tuple(order_ids))
    for text in (f"{slot + 1}\nbecause", f" Agent {slot + 1}.", f"<{slot + 1}>"):
        assert parse_slot(text, order) == slot
        assert (
            read_selection(logits_choosing(0), text, order, CHOICE_IDS).parsed_agent_id
            == (order_ids[slot])
        )
    assert parse_slot("9", order) is None  # not a label of this order
    assert parse_slot("the best one", order) is None


def test_shuffled_orders_are_seeded_per_example_and_are_permutations() -> None:
    orders = {DisplayOrder.shuffled(AGENTS, 7, f"ex{i}").agent_ids for i in range(20)}
    assert all(sorted(o) == list(AGENTS) for o in orders)
    assert len(orders) > 1  # different examples get different orders
    again = DisplayOrder.shuffled(AGENTS, 7, "ex3")
    assert again == DisplayOrder.shuffled(AGENTS, 7, "ex3")  # same seed and example: same order
    assert DisplayOrder.fixed(AGENTS).agent_ids == AGENTS
    with pytest.raises(ValueError, match="repeat"):
        DisplayOrder(("1", "1", "2"))


def test_constrained_ties_go_to_the_lowest_slot() -> None:
    assert constrained_slot(torch.zeros(40), CHOICE_IDS) == (0, 0.0)


@given(st.lists(st.tuples(permutations, st.integers(0, 3), st.integers(0, 3)), min_size=1))
def test_jcr_is_the_share_of_examples_whose_agents_agree(examples) -> None:
    records = []
    for index, (ids, slot, dense_slot) in enumerate(examples):
        order = DisplayOrder(tuple(ids))
        mode = read_selection(logits_choosing(slot), "", order, CHOICE_IDS)
        dense = read_selection(logits_choosing(dense_slot), "", order, CHOICE_IDS)
        records.append(make_judge_record(
            example_id=f"e{index}", order=order.agent_ids, agent_id=mode.agent_id,
            slot=mode.slot, dense_agent_id=dense.agent_id, dense_slot=dense.slot,
        ))  # fmt: skip
    (summary,) = summarize(records)
    # Within one order, same agent <=> same slot: JCR counts slot agreement.
    expected = sum(slot == dense for _, slot, dense in examples) / len(examples)
    assert summary.jcr == pytest.approx(expected)
    assert len(summary.flips) == sum(slot != dense for _, slot, dense in examples)
    assert sum(summary.position_bias) == pytest.approx(1.0)


def test_summary_figures() -> None:
    records = [
        make_judge_record(),
        make_judge_record(example_id="e1", agent_id="2", slot=1, parsed_agent_id=None,
                          correct=True, dense_correct=False, ttft_s=1.5),
    ]  # fmt: skip
    (s,) = summarize(records)
    assert (s.examples, s.jcr, s.coverage, s.jcr_text) == (2, 0.5, 0.5, 1.0)
    assert s.position_bias == (0.5, 0.5, 0.0, 0.0)
    assert s.dense_position_bias == (1.0, 0.0, 0.0, 0.0)
    assert (s.accuracy, s.dense_accuracy) == (1.0, 0.0)  # only e1 is checkable
    assert s.candidate_token_layer_reuse == pytest.approx(1200 / (2 * 40 * 30))
    assert s.token_reuse == pytest.approx(0.4)
    assert s.speedup == pytest.approx(2.0 / 2.0)
    assert s.flips == ("e1",)


def test_dense_against_itself_is_full_jcr() -> None:
    (s,) = summarize([make_judge_record(mode="dense", example_id=f"e{i}") for i in range(3)])
    assert s.jcr == 1.0 and s.coverage == 1.0


def test_candidate_token_layers_counts_only_overlap_with_the_blocks() -> None:
    blocks = [CandidateBlock("2", 10, 20), CandidateBlock("1", 30, 35)]
    reused = [
        ReusedSpan("text_0", "exact", 10, 0, True, 30, start=0),  # before the blocks: 0
        ReusedSpan("agent_2_current+text_3", "naive", 15, 4, False, 30, start=10),  # 10 x 30
        ReusedSpan("agent_1_current", "multicut", 5, 4, False, 12, start=30),  # 5 x 12
    ]
    assert candidate_token_layers(blocks, reused) == 10 * 30 + 5 * 12


class _Digits:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_choice_tokens_must_be_single_distinct_tokens() -> None:
    assert choice_token_ids(_Digits(), ("1", "2")) == (49, 50)
    with pytest.raises(ValueError, match="not one"):
        choice_token_ids(_Digits(), ("1", "10"))


def test_a_call_route_names_the_gate_route_and_the_pass_that_kept_it() -> None:
    gate = "judge (answers=4+selection) -> crossfix: cheapest (predicted ms: exact 30)"
    assert (
        call_route("gated", {"gated": gate, "crossfix": "kept: margin 2.00 >= 1 at check 4"})
        == "crossfix@4"
    )
    assert (
        call_route(
            "gated",
            {
                "gated": gate,
                "crossfix": "dense: margin 0.1 < 1 at check 20, computed on from there",
            },
        )
        == "crossfix>dense"
    )
    assert call_route("gated", {"gated": "judge (role=judge) -> exact: zero drift"}) == "exact"
    assert (
        call_route("crossfix:check=8+margin=0", {"crossfix": "kept: margin 0.01 >= 0 at check 8"})
        == "crossfix@8"
    )
    assert call_route("naive", {}) == "naive"
    staged = "kept: margin 0.07 >= 0 at check 16 (after margin 0.05 < 0.2 at check 4)"
    assert call_route("gated", {"gated": gate, "crossfix": staged}) == "crossfix@16"
    floored = {"gated": gate, "crossfix": staged, "gated_floor": "dense: margin 0.04 < 0.05, "}
    assert call_route("gated", floored) == "crossfix>floor"
    kept = {**floored, "gated_floor": "kept: margin 0.07 >= 0.05"}
    assert call_route("gated", kept) == "crossfix@16"
    exact = {"gated": "judge (role=judge) -> exact: zero drift", "gated_exact": "dense: margin"}
    assert call_route("gated", exact) == "exact>floor"
