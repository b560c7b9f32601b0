"""The LM head every logit the client reads goes through: in float32, whatever the weights.

Owns `Fp32Head` and `fp32_head`. A bf16 head rounds logits near 16 to steps of 0.0625,
so a judge whose label logits lie within a few steps of each other reads ties, and the
rounding of two computations of the same prompt (one prefill, or a reused prefix plus the
rest: bf16 kernels are not chunk-invariant) falls on different sides of a step. From the
final-normed hidden state, the head in float32 gives both the same choice wherever the
states themselves agree (a 0.5B bf16 judge: every near-tie of 8 HumanEval sets). For a
float32 model it is the model's own head. Gemma-style final logit soft-capping is applied
as the model's `*ForCausalLM.forward` applies it.
"""

from __future__ import annotations

import logging
import weakref

import torch
from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


class Fp32Head:
    """`model`'s output embedding as float32 tensors (a copy only when its dtype is not)."""

    def __init__(self, model: PreTrainedModel) -> None:
        head = model.get_output_embeddings()
        weight = head.weight.detach()
        bias = getattr(head, "bias", None)
        self.weight = weight if weight.dtype == torch.float32 else weight.float()
        self.bias = None if bias is None else bias.detach().float()
        config = model.config.get_text_config(decoder=True)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def __call__(self, normed: torch.Tensor) -> torch.Tensor:
        """normed: [..., hidden], after the final norm -> [..., V] float32 logits."""
        logits = torch.nn.functional.linear(normed.float(), self.weight, self.bias)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


_HEADS: weakref.WeakKeyDictionary[PreTrainedModel, Fp32Head] = weakref.WeakKeyDictionary()


def fp32_head(model: PreTrainedModel) -> Fp32Head:
    """The model's float32 head, built once per model object."""
    head = _HEADS.get(model)
    if head is None:
        head = _HEADS[model] = Fp32Head(model)
    return head
