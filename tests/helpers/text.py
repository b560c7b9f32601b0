"""Text for tests without a real tokenizer: a character tokenizer and spanned fake prompts.

Torch-free, so any test (or `scripts/count_call_modules.py`) can use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.client.model.chat_prompt import ChatPrompt, ChatSpan

MARKERS = ("<|im_start|>", "<|im_end|>")


class CharTokenizer:
    """One id per character; the ChatML markers are ids `marker_base` and `marker_base + 1`
    (the second is EOS). A character at or past `marker_base` maps to `marker_base - 1`
    (`clamp`) or keeps its code point."""

    def __init__(self, marker_base: int = 126, *, clamp: bool = True) -> None:
        self.marker_base = marker_base
        self.clamp = clamp
        self.eos_token_id = marker_base + 1

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {"eos_token": MARKERS[1]}

    def get_vocab(self) -> dict[str, int]:
        vocab = {chr(i): i for i in range(self.marker_base)}
        vocab.update({m: self.marker_base + i for i, m in enumerate(MARKERS)})
        return vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        while text:
            marker = next((m for m in MARKERS if text.startswith(m)), None)
            if marker is not None:
                ids.append(self.marker_base + MARKERS.index(marker))
                text = text[len(marker) :]
            else:
                code = ord(text[0])
                ids.append(min(code, self.marker_base - 1) if self.clamp else code)
                text = text[1:]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(self._piece(int(t), skip_special_tokens) for t in token_ids)

    def _piece(self, token_id: int, skip_special_tokens: bool) -> str:
        if token_id < self.marker_base:
            return chr(token_id)
        return "" if skip_special_tokens else MARKERS[token_id - self.marker_base]


@dataclass(frozen=True)
class FakePrompt(ChatPrompt):
    """A chat prompt (a `SpannedPrompt`) that may declare a `role` (`risk_gate.declared_role`)."""

    role: str | None = None


def make_prompt(
    parts: Sequence[tuple[str, str, str | tuple[int, ...]]],
    tokenizer: CharTokenizer | None = None,
    role: str | None = None,
) -> FakePrompt:
    """parts: (kind, name, text or ids) in order -> ids and spans (each part tokenized alone)."""
    tokenizer = tokenizer or CharTokenizer()
    ids: list[int] = []
    spans = []
    for kind, name, value in parts:
        part = tokenizer.encode(value) if isinstance(value, str) else list(value)
        spans.append(ChatSpan(kind, name, len(ids), len(ids) + len(part)))
        ids.extend(part)
    return FakePrompt(tuple(ids), tuple(spans), role)
