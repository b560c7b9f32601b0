"""`sdpa_fp32`: a half-precision model's attention computed by SDPA in float32.

Owns that attention function and its registration with transformers (attention
and mask interfaces), done on import. Why it exists: in bf16 the CPU SDPA kernel
is not chunk-invariant: Qwen2.5-Coder-0.5B's logits after a prefill in two chunks
(a cache, then the rest) differ from one whole prefill by up to 0.16 and greedy
decoding diverges within 32 tokens. Splicing is a chunked prefill, so exact reuse
could not equal dense. Eager attention is chunk-invariant but its bf16 matmuls are
~100x slower on AVX2 CPUs. Projections and MLPs stay in the model's dtype.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

logger = logging.getLogger(__name__)

SDPA_FP32 = "sdpa_fp32"


def sdpa_fp32_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query: [B, H, N, D], key/value: [B, H_kv, T, D] in the model's dtype; the output
    [B, N, H, D] in that dtype, computed in float32 and rounded once."""
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(
        module, query.float(), key.float(), value.float(), attention_mask, **kwargs
    )
    return out.to(query.dtype), weights


AttentionInterface.register(SDPA_FP32, sdpa_fp32_attention)
# The same causal/padding masks as "sdpa": without a registered mask transformers passes
# none, and SDPA's is_causal would align a chunk's queries to the cache's first keys.
AttentionMaskInterface.register(SDPA_FP32, sdpa_mask)
