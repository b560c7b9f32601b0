"""The parts of a model fingerprint that need the model: config, weights, vocabulary.

`kvsplice.common.keys` combines the parts; this module digests a live HF
model and tokenizer into them. Every digest is independent of process state
(no Python `hash`, sorted iteration), so every worker computes the same value.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import xxhash
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from kvsplice.common.keys import FingerprintParts, canonical_json, compute_fingerprint
from kvsplice.kvmath.rope import RopeSpec

logger = logging.getLogger(__name__)

# Config fields that name or describe the checkpoint's provenance, not the math.
VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "_model_name_or_path",
        "_commit_hash",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "architectures",
        "quantization_config",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
    }
)


def model_fingerprint(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, kv_dtype: str
) -> str:
    """`kvfp1-<hex>` over architecture, RoPE, weights, vocabulary and KV dtype."""
    parts = FingerprintParts(
        architecture=architecture_dict(model.config),
        rope=RopeSpec.from_hf_config(model.config.get_text_config(decoder=True)).to_dict(),
        weights_digest=weights_digest(model),
        vocab_digest=vocab_digest(tokenizer),
        kv_dtype=kv_dtype,
    )
    return compute_fingerprint(parts)


def architecture_dict(config: Any) -> dict[str, Any]:
    """The config as a plain dict, minus provenance fields (recursively)."""
    return _strip_volatile(config.to_dict())


def _strip_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_volatile(v) for k, v in value.items() if k not in VOLATILE_CONFIG_KEYS}
    return value


def weights_digest(model: PreTrainedModel) -> str:
    """xxh3-128 over (name, dtype, shape, raw bytes) of every parameter, sorted by name.

    Tied parameters appear once (`named_parameters` deduplicates them); buffers are
    derived from the config (e.g. RoPE inv_freq) and covered by the other parts.
    """
    hasher = xxhash.xxh3_128()
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        tensor = param.detach()
        hasher.update(canonical_json([name, str(tensor.dtype), list(tensor.shape)]).encode())
        hasher.update(_tensor_bytes(tensor))
    return hasher.hexdigest()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    # A uint8 view works for every dtype, bf16 included (numpy has no bf16).
    flat = tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def vocab_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """xxh3-128 over the sorted vocabulary (incl. added tokens) and special tokens."""
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special": sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items()),
    }
    return xxhash.xxh3_128_hexdigest(canonical_json(payload).encode())
