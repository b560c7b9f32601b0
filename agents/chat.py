"""Chat markers of the model family, written into templates as fixed text.

Owns `ChatFormat` (ChatML for SmolLM2) and `chat_template`, which wraps a
system and a user message into one `PromptTemplate`. The markers are plain
template text, so they become ordinary (cacheable) text spans.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvsplice.agents.template import PromptTemplate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatFormat:
    """The literal strings around each chat turn, and the turn-end marker."""

    system_start: str
    user_start: str
    assistant_start: str
    turn_end: str

    def __post_init__(self) -> None:
        if not self.turn_end:
            raise ValueError("turn_end must be non-empty (it is the stop marker)")


# SmolLM2-Instruct's template (`<|im_start|>role\n...<|im_end|>\n`).
CHATML = ChatFormat(
    system_start="<|im_start|>system\n",
    user_start="<|im_start|>user\n",
    assistant_start="<|im_start|>assistant\n",
    turn_end="<|im_end|>",
)


def chat_template(system: str, user: str, chat: ChatFormat = CHATML) -> PromptTemplate:
    """One system turn, one user turn, then the open assistant turn.

    `system` and `user` may contain placeholders; the markers never do.
    """
    text = (
        f"{chat.system_start}{system}{chat.turn_end}\n"
        f"{chat.user_start}{user}{chat.turn_end}\n"
        f"{chat.assistant_start}"
    )
    return PromptTemplate.parse(text)
