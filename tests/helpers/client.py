"""Factories for client tests: a tiny random Llama over `helpers.text`'s character vocabulary."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers.text import CharTokenizer
from kvsplice.client.model.models import LoadedModel, bundle_model

VOCAB = 128  # characters < 126 and the two ChatML markers (`CharTokenizer()`)


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
