"""Factories for client tests: a tiny random Llama, a character tokenizer, spanned prompts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvsplice.client.model.models import LoadedModel, bundle_model

VOCAB = 128
SPECIALS = ("<|im_start|>", "<|im_end|>")


class CharTokenizer:
    """One id per character (ord < 126); the ChatML markers are ids 126 and 127."""

    eos_token_id = 127

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {"eos_token": "<|im_end|>"}

    def get_vocab(self) -> dict[str, int]:
        vocab = {chr(i): i for i in range(126)}
        vocab.update({s: 126 + i for i, s in enumerate(SPECIALS)})
        return vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        while text:
            special = next((s for s in SPECIALS if text.startswith(s)), None)
            if special is not None:
                ids.append(126 + SPECIALS.index(special))
                text = text[len(special) :]
            else:
                ids.append(min(ord(text[0]), 125))
                text = text[1:]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(
            ("" if skip_special_tokens else SPECIALS[t - 126]) if t >= 126 else chr(t)
            for t in token_ids
        )


def make_tiny_llama(dtype: torch.dtype = torch.float32, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rope_theta=10000.0, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


def make_loaded(seed: int = 0) -> LoadedModel:
    return bundle_model(make_tiny_llama(seed=seed), CharTokenizer())


@dataclass(frozen=True)
class FakeSpan:
    kind: str
    name: str
    start: int
    end: int


@dataclass(frozen=True)
class FakePrompt:
    token_ids: tuple[int, ...]
    spans: tuple[FakeSpan, ...]


def make_prompt(parts: Sequence[tuple[str, str, str | tuple[int, ...]]]) -> FakePrompt:
    """parts: (kind, name, text or ids) in order -> ids and spans (each part tokenized alone)."""
    tokenizer = CharTokenizer()
    ids: list[int] = []
    spans = []
    for kind, name, value in parts:
        part = tokenizer.encode(value) if isinstance(value, str) else list(value)
        spans.append(FakeSpan(kind, name, len(ids), len(ids) + len(part)))
        ids.extend(part)
    return FakePrompt(tuple(ids), tuple(spans))
