"""Our own wording of judge pipelines: execution agents' styles and the judge's prompt per task.

Owns only text (GSM8K-, MMLU- and HumanEval-format tasks). Turning it into
roles, graphs and templates is `judge`'s job; the wording is written for
kvsplice, not taken from any paper's code.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsplice.agents.personas import Persona

TASKS = ("gsm8k", "mmlu", "humaneval")
# NOTE: the judge's turn opens with this line and the prompt ends right after its
# trailing space, so the next token is the id itself (ids 1..8 are one digit token):
# the decision position is the prompt's last token.
DECISION_LINE = "Selected agent id: "

# NOTE: the instruction does not list the ids: "one of 1, 2, 3, 4" primed SmolLM2-135M to
# answer 1 (20 of 24 dense picks on the shipped sample under 4 orders each, vs 11 of 24
# without the list), which leaves a judge nothing to be consistent about but its position.

# Distinct voices, so independent agents (parallel exploration) do not all say the same
# thing under greedy decoding; one per execution agent, up to 8.
STYLES = (
    ("careful solver", "You are a careful solver who works step by step."),
    ("quick solver", "You are a quick solver who answers concisely."),
    ("skeptic", "You are a skeptic who double-checks every step before answering."),
    ("teacher", "You are a teacher who explains the reasoning in simple words."),
    ("theorist", "You reason from first principles and state each assumption."),
    ("pragmatist", "You are a pragmatist who prefers the simplest approach that works."),
    ("verifier", "You verify every result a second, independent way before you commit."),
    ("contrarian", "You consider an unusual angle first, then settle on an answer."),
)
MAX_CANDIDATES = len(STYLES)

_INSTRUCTION = {
    "gsm8k": "Solve the problem step by step, then end with the line 'The answer is <number>.'",
    "mmlu": "Say in one or two sentences why, then end with the line 'The answer is <letter>.'",
    "humaneval": "Write the complete function, keeping its name and signature. "
    "Reply with one ```python code block and nothing else.",
}


@dataclass(frozen=True)
class JudgeWording:
    """A judge's fixed text: system message, heading of the answers, closing instruction."""

    system: str
    answers_heading: str
    instruction: str


JUDGES = {
    "gsm8k": JudgeWording(
        "You are the judge of a team of agents. Every agent answered the same math word "
        "problem. You read all of their answers and pick the one agent whose final number "
        "is correct and whose reasoning supports it.",
        "Answers of the agents",
        "Compare all the answers above. Reply with the id of the agent whose answer is best, "
        "on one line: 'Selected agent id: <id>'.",
    ),
    "mmlu": JudgeWording(
        "You are the judge of a team of agents. Every agent answered the same "
        "multiple-choice question. You read all of their answers and pick the one agent "
        "whose chosen option is correct and best justified.",
        "Answers of the agents",
        "Compare all the answers above. Reply with the id of the agent whose answer is best, "
        "on one line: 'Selected agent id: <id>'.",
    ),
    "humaneval": JudgeWording(
        "You are the judge of a team of programmers. Every agent wrote the same Python "
        "function. You read all of their code and pick the one agent whose function is "
        "correct for every input the docstring allows.",
        "Code of the agents",
        "Compare all the functions above. Reply with the id of the agent whose code is "
        "best, on one line: 'Selected agent id: <id>'.",
    ),
}


def check_task(task: str) -> str:
    """`task` if it is one of `TASKS`, else `ValueError` naming them."""
    if task not in TASKS:
        raise ValueError(f"task {task!r} not in {TASKS}")
    return task


def execution_personas(task: str, num_agents: int) -> list[Persona]:
    """The first `num_agents` styles, each with `task`'s answer instruction."""
    check_task(task)
    if not 1 <= num_agents <= MAX_CANDIDATES:
        raise ValueError(f"num_agents {num_agents} outside [1, {MAX_CANDIDATES}]")
    return [Persona(title, system, _INSTRUCTION[task]) for title, system in STYLES[:num_agents]]
