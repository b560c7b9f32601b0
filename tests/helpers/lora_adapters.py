"""LoRA adapters for the bundled model, written in PEFT's on-disk format: random, fixed by a seed.

What vLLM's LoRA loader reads (`adapter_config.json`, `adapter_model.safetensors` with
`base_model.model.<module>.lora_A/B.weight`), on the K and V projections and Q of every
layer, so an adapter changes the K/V a request computes. No training, no `peft` needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj")


def write_adapter(directory: Path, model_dir: str, seed: int, scale: float = 0.2) -> Path:
    """A rank-8 adapter of `model_dir`'s Llama in `directory` (created), its weights drawn
    from `seed`: the same seed writes the same bytes."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    out = {"q_proj": config["num_attention_heads"] * head_dim,
           "k_proj": config["num_key_value_heads"] * head_dim,
           "v_proj": config["num_key_value_heads"] * head_dim}  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in TARGETS:
            name = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            a = torch.randn(RANK, hidden, generator=generator) * scale
            b = torch.randn(out[target], RANK, generator=generator) * scale
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a, b
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(TARGETS),
        "base_model_name_or_path": model_dir, "fan_in_fan_out": False,
    }  # fmt: skip
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=1))
    return directory
