"""OpenAI-style chat messages → a spanned prompt, one message at a time.

Owns `chat_prompt` and `ChatMessage`. The model's own chat template (the
tokenizer's) is applied to growing prefixes of the message list, so message i's
text is exactly what the template adds for it; its role header, its content and
its footer are tokenized separately. Span boundaries are therefore token
boundaries, a message renders to the same ids wherever it appears after the same
messages, and the open assistant header a call ends with is the header its
answer continues in the next call's messages. An assistant message whose text is
an answer this worker generated may be given its generated ids
(`known_outputs`), so the K/V stored for that answer is an exact hit.
It knows nothing about stores or reuse.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

ChatMessage = Mapping[str, str]  # {"role": ..., "content": ...}


class ChatTokenizer(Protocol):
    """The slice of a HF tokenizer this module needs."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class ChatSpan:
    """Tokens [start, end) of one piece: a message's header/footer ("text") or content."""

    kind: str
    name: str
    start: int
    end: int


@dataclass(frozen=True)
class ChatPrompt:
    """Token ids and the spans tiling them (satisfies the engine's `SpannedPrompt`)."""

    token_ids: tuple[int, ...]
    spans: tuple[ChatSpan, ...]


def chat_prompt(
    messages: Sequence[ChatMessage],
    tokenizer: ChatTokenizer,
    *,
    known_outputs: Mapping[str, tuple[int, ...]] | None = None,
) -> ChatPrompt:
    """The prompt for `messages` ending in an open assistant turn.

    Raises `ValueError` for an empty list, a message without role/content, or a
    chat template that does not render messages as growing prefixes.
    """
    if not messages:
        raise ValueError("a chat prompt needs at least one message")
    pieces: list[tuple[str, str, str | tuple[int, ...]]] = []
    rendered = ""
    for index, message in enumerate(messages):
        _check_message(index, message)
        text = _render(tokenizer, messages[: index + 1], generation_prompt=False)
        added = _added(rendered, text, index)
        pieces += _message_pieces(index, message, added, known_outputs or {})
        rendered = text
    tail = _added(rendered, _render(tokenizer, messages, generation_prompt=True), len(messages))
    if tail:
        pieces.append(("text", "generation_prompt", tail))
    return _tokenize(pieces, tokenizer)


def _check_message(index: int, message: ChatMessage) -> None:
    if not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
        raise ValueError(f"message {index} needs a string 'role' and 'content': {message!r}")


def _render(
    tokenizer: ChatTokenizer, messages: Sequence[ChatMessage], *, generation_prompt: bool
) -> str:
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages], tokenize=False, add_generation_prompt=generation_prompt
    )


def _added(before: str, after: str, index: int) -> str:
    if not after.startswith(before):
        raise ValueError(
            f"the chat template does not render message {index} as an extension of the "
            "messages before it; per-message spans need a prefix-stable template"
        )
    return after[len(before) :]


def _message_pieces(
    index: int, message: ChatMessage, added: str, known_outputs: Mapping[str, tuple[int, ...]]
) -> list[tuple[str, str, str | tuple[int, ...]]]:
    """Header, content, footer of one message's rendered text (empty pieces left out)."""
    content = message["content"]
    at = added.rfind(content) if content else -1
    if at < 0:  # the template rewrote the content: the message is one text piece
        return [("text", f"message_{index}", added)]
    body: str | tuple[int, ...] = content
    if message["role"] == "assistant" and content in known_outputs:
        body = known_outputs[content]
    pieces = [
        ("text", f"message_{index}_header", added[:at]),
        ("message", f"message_{index}_{message['role']}", body),
        ("text", f"message_{index}_footer", added[at + len(content) :]),
    ]
    return [p for p in pieces if p[2]]


def _tokenize(
    pieces: Sequence[tuple[str, str, str | tuple[int, ...]]], tokenizer: ChatTokenizer
) -> ChatPrompt:
    token_ids: list[int] = []
    spans: list[ChatSpan] = []
    for kind, name, body in pieces:
        ids = tokenizer.encode(body, add_special_tokens=False) if isinstance(body, str) else body
        if ids:
            spans.append(ChatSpan(kind, name, len(token_ids), len(token_ids) + len(ids)))
            token_ids.extend(int(t) for t in ids)
    return ChatPrompt(tuple(token_ids), tuple(spans))
