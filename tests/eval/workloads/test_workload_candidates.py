"""Candidate blocks of a prompt and the default display order of a workload."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvsplice.eval.workloads.math_problems import MATH_SAMPLE, MathWorkload
from kvsplice.eval.workloads.workload import CandidateBlock, candidate_blocks


@dataclass(frozen=True)
class Span:
    kind: str
    name: str
    start: int
    end: int


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    spans: tuple[Span, ...]


def test_candidate_blocks_are_the_agent_output_placeholders_in_prompt_order() -> None:
    spans = (
        Span("text", "text_0", 0, 4),
        Span("placeholder", "user_question", 4, 9),
        Span("text", "text_2", 9, 11),
        Span("placeholder", "agent_3_current", 11, 20),
        Span("text", "text_4", 20, 22),
        Span("placeholder", "agent_1_current", 22, 30),
        Span("placeholder", "agent_2_current", 30, 30),  # an empty answer is no block
        Span("text", "text_6", 30, 33),
    )
    prompt = Prompt(tuple(range(33)), spans)
    assert candidate_blocks(prompt) == (CandidateBlock("3", 11, 20), CandidateBlock("1", 22, 30))


def test_a_workload_without_candidates_runs_the_order_it_is_given() -> None:
    workload = MathWorkload(MATH_SAMPLE)
    [problem] = workload.problems(1)
    assert workload.orders(problem, ("2", "1", "3")) == (("2", "1", "3"),)


def test_a_candidate_block_is_not_empty() -> None:
    with pytest.raises(ValueError, match="empty"):
        CandidateBlock("1", 5, 5)
