"""The parts of an HF decoder-only model the layerwise executor drives, found once.

Owns reading the model's structure (embedding, decoder layers, rotary tables,
final norm, LM head, per-layer attention windows). It computes nothing the
model does not: layers and rotary tables are the model's own modules. It does
not know about plans, spans or caches.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from kvsplice.client.model.models import fp32_head

logger = logging.getLogger(__name__)

# The executor hands each layer an explicit additive 4-D mask; these two
# attention functions consume it as is (flash ignores masks, flex wants a BlockMask).
SUPPORTED_ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True, eq=False)
class DecoderAdapter:
    """One model's decoder, seen layer by layer.

    layer_types[l]: "full_attention" or "sliding_attention"; windows[l]: the
    sliding window of layer l (query at p sees keys at p' with p - p' < window),
    None for full attention.
    """

    model: PreTrainedModel
    layers: tuple[nn.Module, ...]
    layer_types: tuple[str, ...]
    windows: tuple[int | None, ...]
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    rotary_per_layer_type: bool

    @classmethod
    def from_model(cls, model: PreTrainedModel) -> DecoderAdapter:
        """Read `model`'s structure; ValueError for what the executor cannot drive."""
        cfg = model.config.get_text_config(decoder=True)
        _check_supported(model, cfg)
        num_layers = int(cfg.num_hidden_layers)
        layer_types = _layer_types(cfg, num_layers)
        decoder = model.get_decoder()
        return cls(
            model=model,
            layers=tuple(decoder.layers[:num_layers]),
            layer_types=layer_types,
            windows=tuple(_window(cfg, t) for t in layer_types),
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
            head_dim=int(
                getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            ),
            hidden_size=int(cfg.hidden_size),
            rotary_per_layer_type=_takes_layer_type(decoder.rotary_emb),
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids: [T] long -> [T, hidden], through the model's own (maybe scaled) embedding."""
        return self.model.get_input_embeddings()(token_ids.to(self.device))

    def position_embeddings(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) [1, N, D] per layer type, from the model's rotary module.

        hidden: [1, N, hidden] (only its dtype/device are read); positions: [1, N] long.
        Gemma3-style rotary modules take the layer type (local vs global tables).
        """
        rotary = self.model.get_decoder().rotary_emb
        if self.rotary_per_layer_type:
            return {t: rotary(hidden, positions, t) for t in set(self.layer_types)}
        shared = rotary(hidden, positions)
        return dict.fromkeys(set(self.layer_types), shared)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden], the residual stream after the last layer -> [N, V] float32.

        The model's final norm, then its LM head in float32 (`models.fp32_head`), as the call
        executor's forward reads every other logit.
        """
        return fp32_head(self.model)(self.model.get_decoder().norm(hidden))


def _check_supported(model: PreTrainedModel, cfg: object) -> None:
    impl = model.config._attn_implementation
    if impl not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attn_implementation {impl!r} not in {SUPPORTED_ATTN_IMPLEMENTATIONS}: "
            "the layerwise executor passes an explicit additive mask"
        )
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=True models are not causal decoders")
    if not hasattr(model.get_decoder(), "rotary_emb"):
        raise ValueError(f"{type(model).__name__} has no decoder-level rotary_emb module")


def _layer_types(cfg: object, num_layers: int) -> tuple[str, ...]:
    """Per-layer attention type; without `layer_types` a set `sliding_window` means all sliding (Mistral)."""
    types: Sequence[str] | None = getattr(cfg, "layer_types", None)
    if types is None:
        sliding = getattr(cfg, "sliding_window", None) is not None
        types = [SLIDING_ATTENTION if sliding else FULL_ATTENTION] * num_layers
    unknown = sorted(set(types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(
            f"layer types {unknown} are not supported (only full and sliding attention)"
        )
    return tuple(types[:num_layers])


def _window(cfg: object, layer_type: str) -> int | None:
    if layer_type == FULL_ATTENTION:
        return None
    window = getattr(cfg, "sliding_window", None)
    if window is None or window < 1:
        raise ValueError(f"sliding layer with sliding_window {window!r}")
    return int(window)


def _takes_layer_type(rotary: nn.Module) -> bool:
    return "layer_type" in inspect.signature(rotary.forward).parameters
