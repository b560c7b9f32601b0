"""Which block layout an engine writes, read from vLLM's resolved config: `check_supported`.

Needs no KV tensor, so the scheduler and the worker reach the same verdict before any
hit is promised. Moving blocks in and out of a layout belongs to `block_layout`.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

CPU = "cpu"
FLASH = "flash"

# NOTE: in vLLM 0.32 every layer's cache reaches a connector as the 4-D view
# `[num_blocks, H_kv, block_size, 2 * D]` (`kv_cache_interface.create_kv_cache_views`).
# The CUDA backends below all read it as `kv_cache.transpose(1, 2).split(head_size, -1)`:
# K is the first D of the last dim, V the last D (whatever the stride order). CPU_ATTN
# packs each (block, head) slab its own ISA-dependent way (`CpuBlockLayout.probe`).
# A backend not listed here is refused rather than guessed.
KIND_OF_BACKEND = {
    "CPU_ATTN": CPU,
    "FLASH_ATTN": FLASH,
    "FLASHINFER": FLASH,
    "TRITON_ATTN": FLASH,
    "FLEX_ATTENTION": FLASH,
}


class UnsupportedLayout(Exception):
    """The engine's KV cache has a layout this connector cannot read (it then stays idle)."""


def check_supported(vllm_config: Any) -> str:
    """The layout kind (`CPU` or `FLASH`) of the engine `vllm_config` describes.

    Raises UnsupportedLayout for MLA models, a `cache_dtype` other than "auto", an
    attention backend outside `KIND_OF_BACKEND`, or backends of two kinds at once.
    """
    model_config = vllm_config.model_config
    if model_config is None:
        raise UnsupportedLayout("the vLLM config has no model config")
    if model_config.use_mla:
        raise UnsupportedLayout(
            f"{model_config.model} uses MLA (a latent KV cache); kvsplice stores per-head K/V"
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise UnsupportedLayout(
            f"kv cache_dtype {cache_dtype!r}: kvsplice stores K/V in the model's dtype only "
            "(run with --kv-cache-dtype auto)"
        )
    names = backend_names(vllm_config)
    unknown = sorted(names - KIND_OF_BACKEND.keys())
    if unknown:
        raise UnsupportedLayout(
            f"attention backend {', '.join(unknown)} has no kvsplice block layout "
            f"(supported: {', '.join(KIND_OF_BACKEND)})"
        )
    kinds = {KIND_OF_BACKEND[name] for name in names}
    if len(kinds) != 1:
        raise UnsupportedLayout(f"attention backends {sorted(names)} mix block layouts")
    return kinds.pop()


def backend_names(vllm_config: Any) -> set[str]:
    """The names of the attention backends the engine uses (e.g. {"FLASH_ATTN"}).

    Those of the model's layers once it is loaded (a worker, from `register_kv_caches`
    on), else the one vLLM's own selector picks for this model's decoder attention.
    """
    return _loaded_backend_names(vllm_config) or {_selected_backend_name(vllm_config)}


def _loaded_backend_names(vllm_config: Any) -> set[str]:
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = vllm_config.compilation_config.static_forward_context.values()
    return {
        layer.get_attn_backend().get_name()
        for layer in layers
        if isinstance(layer, AttentionLayerBase)
    }


def _selected_backend_name(vllm_config: Any) -> str:
    # NOTE: this asks the selector what `Attention.__init__` asks it for a plain decoder
    # layer (head size, model dtype, cache dtype), so the scheduler, which never loads the
    # model, predicts the worker's backend. Per-layer traits it cannot see (sinks, sliding
    # windows) are checked again from the loaded layers on the worker.
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    model_config = vllm_config.model_config
    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(
            model_config.get_head_size(),
            model_config.dtype,
            vllm_config.cache_config.cache_dtype,
            use_mla=False,
            use_mm_prefix=model_config.is_mm_prefix_lm,
        )
    return str(backend.get_name())
