"""Factories for layerwise-executor tests: tiny random Llama / Qwen2 / Gemma3 and dense oracles."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma3TextConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
)

from kvsplice.client.model.hf_cache import cache_kwarg

VOCAB = 101
NUM_LAYERS = 4
GEMMA_WINDOW = 4
COMMON = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}  # fmt: skip


def make_config(arch: str, attn: str = "sdpa") -> PretrainedConfig:
    """4 layers, 4 query / 2 KV heads (GQA); Gemma3: sliding window 4 on layers 0, 1, 3."""
    if arch == "llama":
        return LlamaConfig(**COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           attn_implementation=attn)  # fmt: skip
    if arch == "qwen2":
        return Qwen2Config(**COMMON, attn_implementation=attn)
    if arch == "gemma3":
        return Gemma3TextConfig(
            **COMMON, head_dim=16, sliding_window=GEMMA_WINDOW, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            attn_implementation=attn,
        )  # fmt: skip
    raise ValueError(f"unknown arch {arch!r}")


def make_model(arch: str, attn: str = "sdpa", seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(make_config(arch, attn)).float().eval()


def make_prompt(num_tokens: int, seed: int = 1) -> tuple[int, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, VOCAB, (num_tokens,), generator=generator).tolist())


def dense_forward(
    model: PreTrainedModel, ids: Sequence[int], position_offset: int = 0
) -> tuple[torch.Tensor, DynamicCache]:
    """The model's own forward: all-token logits [T, V] float32 and its full-length cache."""
    cache = DynamicCache()
    positions = torch.arange(len(ids)).unsqueeze(0) + position_offset
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids)]), position_ids=positions,
                    **cache_kwarg(model, cache), use_cache=True)  # fmt: skip
    return out.logits[0].float(), cache


def dense_kv(cache: DynamicCache, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of tokens [start, end) from a dense cache: [L, H_kv, end - start, D] each."""
    keys = torch.stack([layer.keys[0, :, start:end] for layer in cache.layers])
    values = torch.stack([layer.values[0, :, start:end] for layer in cache.layers])
    return keys, values
