"""Tiny random-weight HF models and a word-level tokenizer for client tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

VOCAB = 97


def make_tiny_llama(seed: int = 0, rope_theta: float = 10000.0) -> LlamaForCausalLM:
    """2 layers, hidden 64, 4 query / 2 KV heads (GQA), fp32, eval mode."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def make_tiny_gemma3(sliding_window: int = 4, seed: int = 0) -> Gemma3ForCausalLM:
    """3 layers (sliding, sliding, full), distinct local/global RoPE θ, a short window."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=sliding_window, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        attn_implementation="eager",
    )  # fmt: skip
    return Gemma3ForCausalLM(config).eval()


def make_word_tokenizer(rename: dict[str, str] | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over VOCAB words `w0 .. w96`; `rename` swaps entries."""
    words = [f"w{i}" for i in range(VOCAB)]
    words = [(rename or {}).get(word, word) for word in words]
    model = WordLevel({word: i for i, word in enumerate(words)}, unk_token=words[0])
    backend = Tokenizer(model)
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=words[0], eos_token=words[1])


def make_prompt(num_tokens: int, seed: int = 1) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (num_tokens,), generator=generator).tolist()
