"""Factories for client tests: a tiny random Llama over `helpers.text`'s character vocabulary."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from helpers.text import CharTokenizer
from kvsplice.client.model.models import LoadedModel, bundle_model
from kvsplice.server.embedded import EmbeddedStore, loopback_config

VOCAB = 128  # characters < 126 and the two ChatML markers (`CharTokenizer()`)


def make_tiny_llama(
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    *,
    vocab_size: int = VOCAB,
    hidden_size: int = 64,
    num_layers: int = 2,
    max_positions: int = 4096,
) -> LlamaForCausalLM:
    """A random Llama (4 query / 2 KV heads: GQA, eager attention, eval) seeded by `seed`."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, rope_theta=10000.0, attn_implementation="eager",
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype).eval()


def make_loaded(seed: int = 0) -> LoadedModel:
    return bundle_model(make_tiny_llama(seed=seed), CharTokenizer())


@pytest.fixture(scope="module")
def store_target() -> Iterator[str]:
    """A module's embedded store (memory tier only), by its gRPC target."""
    with EmbeddedStore(loopback_config(None)) as store:
        yield store.target
