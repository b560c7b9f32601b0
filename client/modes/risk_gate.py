"""The judge risk gate's classification: is a call judge-like (its outcome rests on comparing answers)?

Owns `JudgeVerdict` and `classify`. A call is judge-like when its prompt declares a
judge role, or, for prompts that declare none, when it holds two or more spans that
are other agents' answers followed by an instruction to select among them (seed 001:
reuse that is harmless for execution agents flips such a call's choice). Routing a
judge-like call is the gated policy's job; this module only looks at the prompt.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsplice.client.modes.base import SpannedPrompt, span_role

logger = logging.getLogger(__name__)

JUDGE_ROLES = frozenset({"judge"})
MIN_ANSWERS = 2
# A selection instruction names a choosing verb (or the decision line) and what is
# chosen among: agents, answers, candidates. "choose the correct option" (a multiple-
# choice agent's own task, even with "The answer is <letter>" after it) names none of them
# and is not one: plural answers, or agents and candidates, or "the best answer".
_CHOSEN = r"(?:agents?|candidates?|answers|responses|solutions|submissions|ids)"
_ONE_CHOSEN = r"(?:agent|candidate|answer|response|solution|submission)"
SELECTION_PATTERN = re.compile(
    rf"selected\s+agent\s+id"
    rf"|\b(?:select|choose|pick|rank|vote\s+for|decide\s+which)\b[^.\n]{{0,60}}?\b{_CHOSEN}\b"
    rf"|\bwhich\b[^.\n]{{0,30}}?\b{_CHOSEN}\b[^.\n]{{0,40}}?\bbest\b"
    rf"|\bbest\s+{_ONE_CHOSEN}s?\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class JudgeVerdict:
    """judge_like, and why: "role=judge", "role=<other>", "answers=3+selection", "answers=1"."""

    judge_like: bool
    reason: str


def declared_role(prompt: SpannedPrompt) -> str | None:
    """The role a prompt declares (`prompt.role`, optional on the protocol), lowercased."""
    role = getattr(prompt, "role", None)
    return role.strip().lower() if isinstance(role, str) and role.strip() else None


def classify(prompt: SpannedPrompt, decode_text: Callable[[Sequence[int]], str]) -> JudgeVerdict:
    """Judge-like by declared role; without one, by ≥2 answer spans then a selection instruction."""
    role = declared_role(prompt)
    if role is not None:
        return JudgeVerdict(role in JUDGE_ROLES, f"role={role}")
    answers = [s for s in prompt.spans if span_role(s) == "agent_output"]
    if len(answers) < MIN_ANSWERS:
        return JudgeVerdict(False, f"answers={len(answers)}")
    tail = decode_text(prompt.token_ids[max(s.end for s in answers) :])
    if SELECTION_PATTERN.search(tail) is None:
        return JudgeVerdict(False, f"answers={len(answers)}+no-selection")
    return JudgeVerdict(True, f"answers={len(answers)}+selection")
