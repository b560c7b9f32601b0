"""Rendering a template to token ids with the exact token range of every span.

Owns `Span`, `RenderedPrompt` and `render`. It tokenizes; it never runs a model
and never decides what to reuse (that is `kvsplice.client`'s policies).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvsplice.agents.template import PlaceholderPart, PromptTemplate, TextPart
from kvsplice.client.execute.plan import check_tiling

logger = logging.getLogger(__name__)

SpanKind = Literal["text", "placeholder"]
PlaceholderValue = str | Sequence[int]


class Tokenizer(Protocol):
    """The slice of a HF tokenizer rendering needs."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class Span:
    """Tokens `[start, end)` of a rendered prompt that came from one template part.

    `name` is the placeholder name for placeholders and `text_<i>` (i = index of
    the part in the template) for fixed text.
    """

    kind: SpanKind
    name: str
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(
                f"span {self.name!r} range [{self.start}, {self.end}) is empty or negative"
            )

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt's token ids and its spans, which tile `token_ids` in order.

    `choice_ids`: when the caller reads the answer as a constrained choice (a judge's
    candidate labels), the tokens it compares at the first generated position; a judge
    mode's guard then measures the decision's margin over them (empty: none declared).
    """

    token_ids: tuple[int, ...]
    spans: tuple[Span, ...]
    choice_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_tiling(self.spans, len(self.token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def span_ids(self, span: Span) -> tuple[int, ...]:
        return self.token_ids[span.start : span.end]

    def span_named(self, name: str) -> Span | None:
        return next((s for s in self.spans if s.name == name), None)


def tokenize_text(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    """Ids of `text` alone, without BOS/EOS (chat markers are ordinary text here)."""
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def render(
    template: PromptTemplate,
    values: Mapping[str, PlaceholderValue],
    tokenizer: Tokenizer,
) -> RenderedPrompt:
    """Fill `template` with `values` and tokenize it part by part.

    Each text part and each placeholder value is tokenized *separately* and the
    ids are concatenated, so every span boundary is a token boundary: no BPE
    merge crosses it and a span's ids are exactly what its part tokenizes to
    (KVComm measured `drop_num` by assuming this; here it holds by construction).
    The result may differ from tokenizing the whole filled string at once.
    A value given as ids (an upstream agent's generated tokens) is used verbatim,
    so that agent's response KV lines up token for token. Empty values give
    zero-length spans, which are left out. Raises `ValueError` for a
    placeholder without a value.
    """
    missing = [name for name in template.placeholder_names if name not in values]
    if missing:
        raise ValueError(f"no value for placeholder(s) {missing}")
    token_ids: list[int] = []
    spans: list[Span] = []
    for index, part in enumerate(template.parts):
        kind, name, ids = _part_ids(index, part, values, tokenizer)
        if ids:
            spans.append(Span(kind, name, len(token_ids), len(token_ids) + len(ids)))
            token_ids.extend(ids)
    return RenderedPrompt(tuple(token_ids), tuple(spans))


def _part_ids(
    index: int,
    part: TextPart | PlaceholderPart,
    values: Mapping[str, PlaceholderValue],
    tokenizer: Tokenizer,
) -> tuple[SpanKind, str, tuple[int, ...]]:
    if isinstance(part, TextPart):
        return "text", f"text_{index}", tokenize_text(tokenizer, part.text)
    name = part.placeholder.name
    value = values[name]
    ids = (
        tokenize_text(tokenizer, value) if isinstance(value, str) else tuple(int(t) for t in value)
    )
    return "placeholder", name, ids
