"""Factories for agents tests: a character tokenizer with ChatML markers as single ids."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import text
from helpers.text import MARKERS
from kvsplice.client.model.models import LoadedModel, bundle_model

MARKER_BASE = 1000


class CharTokenizer(text.CharTokenizer):
    """One id per character (its code point, unclamped); the ChatML markers are 1000 and 1001."""

    def __init__(self) -> None:
        super().__init__(MARKER_BASE, clamp=False)


def make_tiny_loaded(seed: int = 0) -> LoadedModel:
    """A 2-layer random Llama (GQA) over the character vocabulary, with that tokenizer."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=MARKER_BASE + len(MARKERS), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=8192, attn_implementation="eager",
    )  # fmt: skip
    return bundle_model(LlamaForCausalLM(config).eval(), CharTokenizer())
