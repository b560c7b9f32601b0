"""Factories for agents tests: a character tokenizer with ChatML markers as single ids."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvsplice.client.model.models import LoadedModel, bundle_model

MARKERS = ("<|im_start|>", "<|im_end|>")
MARKER_BASE = 1000


class CharTokenizer:
    """One id per character (its code point); the ChatML markers are ids 1000 and 1001."""

    eos_token_id = MARKER_BASE + 1

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {"eos_token": MARKERS[1]}

    def get_vocab(self) -> dict[str, int]:
        vocab = {chr(i): i for i in range(MARKER_BASE)}
        vocab.update({m: MARKER_BASE + i for i, m in enumerate(MARKERS)})
        return vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        while text:
            marker = next((m for m in MARKERS if text.startswith(m)), None)
            if marker is not None:
                ids.append(MARKER_BASE + MARKERS.index(marker))
                text = text[len(marker) :]
            else:
                ids.append(ord(text[0]))
                text = text[1:]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        def piece(t: int) -> str:
            if t < MARKER_BASE:
                return chr(t)
            return "" if skip_special_tokens else MARKERS[t - MARKER_BASE]

        return "".join(piece(t) for t in token_ids)


def make_tiny_loaded(seed: int = 0) -> LoadedModel:
    """A 2-layer random Llama (GQA) over the character vocabulary, with that tokenizer."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=MARKER_BASE + len(MARKERS), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8192, attn_implementation="eager",
    )  # fmt: skip
    return bundle_model(LlamaForCausalLM(config).eval(), CharTokenizer())
