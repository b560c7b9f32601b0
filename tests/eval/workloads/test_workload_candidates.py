"""Candidate blocks of a prompt and the default display order of a workload."""

from __future__ import annotations

import pytest
from helpers.text import FakePrompt

from kvsplice.client.model.chat_prompt import ChatSpan
from kvsplice.eval.workloads.math_problems import MATH_SAMPLE, MathWorkload
from kvsplice.eval.workloads.workload import CandidateBlock, candidate_blocks


def test_candidate_blocks_are_the_agent_output_placeholders_in_prompt_order() -> None:
    spans = (
        ChatSpan("text", "text_0", 0, 4),
        ChatSpan("placeholder", "user_question", 4, 9),
        ChatSpan("text", "text_2", 9, 11),
        ChatSpan("placeholder", "agent_3_current", 11, 20),
        ChatSpan("text", "text_4", 20, 22),
        ChatSpan("placeholder", "agent_1_current", 22, 30),
        ChatSpan("placeholder", "agent_2_current", 30, 30),  # an empty answer is no block
        ChatSpan("text", "text_6", 30, 33),
    )
    prompt = FakePrompt(tuple(range(33)), spans)
    assert candidate_blocks(prompt) == (CandidateBlock("3", 11, 20), CandidateBlock("1", 22, 30))


def test_a_workload_without_candidates_runs_the_order_it_is_given() -> None:
    workload = MathWorkload(MATH_SAMPLE)
    [problem] = workload.problems(1)
    assert workload.orders(problem, ("2", "1", "3")) == (("2", "1", "3"),)


def test_a_candidate_block_is_not_empty() -> None:
    with pytest.raises(ValueError, match="empty"):
        CandidateBlock("1", 5, 5)
