"""Prompt templates: fixed text parts alternating with named placeholders.

Owns the placeholder grammar (KVComm's names) and the parse of a template string
into parts. It knows nothing about tokenizers (see `render`) or about which
agent fills what (see `graph`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Literal

logger = logging.getLogger(__name__)

PlaceholderKind = Literal[
    "user_question", "agent_current", "agent_history", "condition_current", "condition_history"
]

# Ids are alphanumeric (no underscore) so `agent_1_history_-1` splits one way only;
# a history turn is relative to the running round (-1 = the previous round).
_ID = r"[A-Za-z0-9]+"
PLACEHOLDER_PATTERN = re.compile(
    r"\{(?P<name>user_question"
    r"|(?P<source>agent|condition)_(?P<id>" + _ID + r")_(?:current|history_(?P<turn>-?\d+)))\}"
)

# (source, has a history turn) -> the kind of an agent or condition placeholder
_KINDS: dict[tuple[str, bool], PlaceholderKind] = {
    ("agent", False): "agent_current", ("agent", True): "agent_history",
    ("condition", False): "condition_current", ("condition", True): "condition_history",
}  # fmt: skip


@dataclass(frozen=True)
class Placeholder:
    """A parsed placeholder name such as `agent_2_history_-1` (without braces)."""

    name: str
    kind: PlaceholderKind
    source_id: str = ""
    turn: int = 0

    @classmethod
    def parse(cls, name: str) -> Placeholder:
        """Parse `name` (with or without braces); `ValueError` if it is not one."""
        match = PLACEHOLDER_PATTERN.fullmatch(name if name.startswith("{") else f"{{{name}}}")
        if match is None:
            raise ValueError(f"{name!r} is not a placeholder name")
        return _from_match(match)

    @property
    def is_agent_output(self) -> bool:
        return self.kind in ("agent_current", "agent_history")


def agent_current(agent_id: str) -> str:
    """Placeholder name of `agent_id`'s answer in the running round."""
    return Placeholder.parse(f"agent_{agent_id}_current").name


def agent_history(agent_id: str, turn: int = -1) -> str:
    """Placeholder name of `agent_id`'s answer `-turn` rounds ago."""
    if turn >= 0:
        raise ValueError(f"history turn {turn} must be negative (rounds before the running one)")
    return Placeholder.parse(f"agent_{agent_id}_history_{turn}").name


def _from_match(match: re.Match[str]) -> Placeholder:
    name = match["name"]
    if name == "user_question":
        return Placeholder(name, "user_question")
    kind = _KINDS[(match["source"], match["turn"] is not None)]
    turn = int(match["turn"]) if match["turn"] is not None else 0
    return Placeholder(name, kind, match["id"], turn)


@dataclass(frozen=True)
class TextPart:
    """Literal template text (braces that are not placeholders stay literal)."""

    text: str


@dataclass(frozen=True)
class PlaceholderPart:
    placeholder: Placeholder


TemplatePart = TextPart | PlaceholderPart


@dataclass(frozen=True)
class PromptTemplate:
    """A template: its parts in order. Build one with `PromptTemplate.parse`."""

    parts: tuple[TemplatePart, ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("a template needs at least one part")
        for left, right in zip(self.parts, self.parts[1:], strict=False):
            if isinstance(left, TextPart) and isinstance(right, TextPart):
                raise ValueError(
                    f"adjacent text parts {left.text!r} and {right.text!r}; merge them"
                )

    @classmethod
    def parse(cls, text: str) -> PromptTemplate:
        """Split `text` at placeholders. Whitespace-only text parts are kept."""
        parts: list[TemplatePart] = []
        cursor = 0
        for match in PLACEHOLDER_PATTERN.finditer(text):
            if match.start() > cursor:
                parts.append(TextPart(text[cursor : match.start()]))
            parts.append(PlaceholderPart(_from_match(match)))
            cursor = match.end()
        if cursor < len(text):
            parts.append(TextPart(text[cursor:]))
        return cls(tuple(parts))

    @property
    def placeholders(self) -> tuple[Placeholder, ...]:
        return tuple(p.placeholder for p in self.parts if isinstance(p, PlaceholderPart))

    @property
    def placeholder_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.placeholders)

    def source_text(self) -> str:
        """The template string back (parse(source_text()) == self)."""
        return "".join(
            p.text if isinstance(p, TextPart) else f"{{{p.placeholder.name}}}" for p in self.parts
        )
