"""The transcript layout at the token level, for engines driven by token ids (vLLM).

Agent k's prompt is agent k-1's prompt, then k-1's answer exactly as the engine
generated it, then agent k's instruction as a new chat turn: every earlier token
is a prefix, so exact reuse covers all of it (DESIGN: prompt layouts). The chat
template renders the turn markup, so this works for any chat model's tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_MARK = "\u2063kvsplice-answer\u2063"

PIPELINE_ROLES: tuple[tuple[str, str], ...] = (
    ("planner", "Read the task above carefully. Write a numbered plan of the steps a careful "
     "engineer would take to solve it: the inputs and outputs, the edge cases to handle, the data "
     "structures to use and how to test the result. Do not write the code yet."),
    ("solver", "Follow the plan above and write the complete Python solution. Keep the function "
     "signature exactly as given, handle every edge case the plan lists, and explain each part of "
     "the code in a short comment."),
    ("critic", "Review the solution above line by line as a strict code reviewer. List every bug, "
     "missed edge case, wrong assumption and performance problem you can find, and say for each "
     "one how it should be fixed."),
    ("reviser", "Rewrite the solution so that it addresses every point of the review above. Give "
     "the full corrected function, then two or three example calls with their expected results."),
    ("judge", "Decide whether the final solution above is correct. Answer with one word, PASS or "
     "FAIL, then justify the verdict in two sentences that cite the relevant lines."),
)  # fmt: skip
SYSTEM_PROMPT = (
    "You are one agent in a team of programming assistants that solve a task together. Each agent "
    "sees the whole conversation so far: the task, the earlier agents' instructions and their "
    "answers. Be precise, keep to your own role, and build on what the earlier agents wrote."
)

# A team's standing instructions, as real pipelines carry them in every agent's system prompt
# (coding standards, output format, tool rules): the shared context `bench vllm` uses.
TEAM_CONVENTIONS = """
Team conventions, which every agent follows:
1. Python 3.11, standard library only unless the task says otherwise. Type hints on every
   public function, a docstring that states what the function promises, not how it works.
2. Functions stay short: one purpose each, at most about twenty lines; a helper gets a name that
   says what it returns. No global state, no printing from library code, no bare except.
3. Inputs are validated at the boundary: a wrong type or an out-of-range value raises ValueError
   or TypeError with a message that names the bad value. Empty inputs are handled explicitly.
4. Complexity matters: say the time and memory complexity of the solution and prefer an
   O(n log n) or better approach when the input can be large. Never sort inside a loop.
5. Tests: every edge case the plan lists gets a test with its expected value; the examples in the
   task's docstring are tests too. Tests are deterministic and never depend on time or order.
6. Reviews cite line numbers, separate bugs from style, and propose the smallest fix first.
7. Answers use Markdown: code in fenced python blocks, explanations in short numbered points.
8. When the task is ambiguous, state the assumption made and keep to it consistently.
9. Never invent library functions; if unsure whether something exists, write it by hand.
10. The final answer of the team is a single function that passes every test listed so far.
""".strip()


@dataclass(frozen=True)
class TokenTranscript:
    """Builds each agent's prompt ids from the previous prompt and answer ids."""

    tokenizer: Any  # a transformers tokenizer with a chat template
    system: str = SYSTEM_PROMPT

    def first_prompt(self, task: str, instruction: str) -> list[int]:
        messages = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": f"{task}\n\n{instruction}"},
        ]
        return list(self._render(messages, tokenize=True))

    def next_prompt(
        self, prompt_ids: Sequence[int], answer_ids: Sequence[int], instruction: str
    ) -> list[int]:
        """`prompt_ids + answer_ids` (its end-of-turn token dropped) + the next user turn."""
        answer = list(answer_ids)
        if answer and answer[-1] == self.tokenizer.eos_token_id:
            answer = answer[:-1]  # the turn markup below closes the answer itself
        return [*prompt_ids, *answer, *self._turn_after_answer(instruction)]

    def _turn_after_answer(self, instruction: str) -> list[int]:
        messages = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": "task"},
            {"role": "assistant", "content": _MARK},
            {"role": "user", "content": instruction},
        ]
        text = self._render(messages, tokenize=False)
        suffix = text[text.index(_MARK) + len(_MARK) :]
        return list(self.tokenizer.encode(suffix, add_special_tokens=False))

    def _render(self, messages: list[dict[str, str]], *, tokenize: bool) -> Any:
        rendered = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=tokenize
        )
        if tokenize and hasattr(rendered, "keys"):  # transformers >= 5: a BatchEncoding
            return rendered["input_ids"]
        return rendered


# Persona-first (seed 002's setting, DESIGN: prompt layouts): each agent under a system prompt
# of its own, then the shared context and the earlier agents' answers quoted in its user turn.
# Nothing past an agent's own system prompt is a prefix of another agent's prompt.
PERSONAS: dict[str, str] = {
    "planner": "You are the planner of a team of programming assistants. You turn a task into a "
    "short numbered plan that the other agents can follow; you never write the code yourself.",
    "solver": "You are the solver of a team of programming assistants. You write complete, "
    "working Python that follows the plan you are given, and you keep your explanations brief.",
    "critic": "You are the critic of a team of programming assistants. You read code like a strict "
    "reviewer, find bugs and missed edge cases, and say exactly how each should be fixed.",
    "reviser": "You are the reviser of a team of programming assistants. You rewrite a solution "
    "so that it addresses every point of a review, and you show that it works with examples.",
    "judge": "You are the judge of a team of programming assistants. You decide whether the final "
    "solution is correct and justify your verdict briefly, citing the lines that matter.",
}  # fmt: skip


@dataclass(frozen=True)
class PersonaTranscript:
    """Agent k's prompt: its persona as the system prompt, then `context`, the task, the
    earlier agents' answers (as text, each under its role's name) and its instruction."""

    tokenizer: Any  # a transformers tokenizer with a chat template
    context: str = TEAM_CONVENTIONS
    personas: Mapping[str, str] = field(default_factory=lambda: PERSONAS)

    def prompt(
        self, role: str, task: str, answers: Sequence[tuple[str, Sequence[int]]], instruction: str
    ) -> list[int]:
        quoted = "".join(f"The {name} wrote:\n{self._text(ids)}\n\n" for name, ids in answers)
        user = f"{self.context}\n\nThe task:\n{task}\n\n{quoted}{instruction}"
        messages = [
            {"role": "system", "content": self.personas[role]},
            {"role": "user", "content": user},
        ]
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _text(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True)).strip()
