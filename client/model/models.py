"""Loading the worker's model: a packaged GGUF (SmolLM2, Qwen2.5-Coder) or any local HF directory.

Owns the one-time GGUF -> safetensors conversion and the `LoadedModel` bundle (model,
tokenizer, fingerprint, KV layout, RoPE spec) and the model's LM head in float32 that every
logit the client reads goes through (`fp32_head`, built once per model object, whatever
the weights' dtype: a bf16 head rounds logits near 16 to steps of 0.0625, so a judge reads
ties and two computations of one prompt, a prefill or a reused prefix plus the rest, round
to different sides of a step; Gemma-style final soft-capping applied as the model's
`*ForCausalLM.forward` applies it). Where a packaged model's GGUF lies is
`packaged_models`', where its converted copy lies `model_cache`'. It never touches a model
hub and never reads environment variables (the CLI does).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from kvsplice.client.model.fingerprinting import model_fingerprint
from kvsplice.client.model.model_cache import converted_dir, is_converted
from kvsplice.client.model.model_config import DEFAULT_CACHE_DIR as DEFAULT_CACHE_DIR
from kvsplice.client.model.model_config import ModelConfig
from kvsplice.client.model.packaged_models import (
    PACKAGED_MODELS,
    SMOLLM2_MODEL,
    PackagedModel,
    assemble_gguf,
)
from kvsplice.common.layout import KVLayout
from kvsplice.kvmath.rope import RopeSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for capture and splice, with the facts payloads must agree with."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str
    layout: KVLayout
    rope: RopeSpec

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end the model's turn: its generation config's `eos_token_id`
        (an int or a list), else its config's, else the tokenizer's."""
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                return tuple(int(t) for t in (eos if isinstance(eos, list | tuple) else [eos]))
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return () if eos is None else (int(eos),)

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        """The text of one sequence of ids (the tokenizer's `decode` of a flat list)."""
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # a list of ids decodes to one string, never a batch
        return text


def load_model(config: ModelConfig) -> LoadedModel:
    """Load `config.source` (converting the bundled GGUF once), in eval mode."""
    model_dir = _resolve_model_dir(config)
    dtype = getattr(torch, config.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        attn_implementation=config.attn_implementation,
        device_map=config.device,
        local_files_only=True,
    )
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    return bundle_model(model, tokenizer)


@functools.lru_cache(maxsize=4)
def load_model_cached(config: ModelConfig) -> LoadedModel:
    """`load_model`, once per process per config (tests share one model)."""
    return load_model(config)


def bundle_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> LoadedModel:
    """Wrap an already-loaded model (e.g. a tiny random one in tests)."""
    layout = kv_layout(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        fingerprint=model_fingerprint(model, tokenizer, layout.dtype),
        layout=layout,
        rope=RopeSpec.from_hf_config(model.config.get_text_config(decoder=True)),
    )


def kv_layout(model: PreTrainedModel) -> KVLayout:
    """The KV geometry of a decoder-only HF model (text config for multimodal ones)."""
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVLayout(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        dtype=str(model.dtype).removeprefix("torch."),
    )


def _resolve_model_dir(config: ModelConfig) -> Path:
    packaged = PACKAGED_MODELS.get(config.source)
    if packaged is None:
        return Path(config.source).expanduser()
    return converted_model_dir(packaged, config.cache_dir.expanduser())


def converted_smollm2_dir(cache_dir: Path) -> Path:
    return converted_model_dir(SMOLLM2_MODEL, cache_dir)


def converted_model_dir(packaged: PackagedModel, cache_dir: Path) -> Path:
    """The safetensors copy of a packaged GGUF, converting it on first use.

    A whole copy already in the cache is used as it is (a pinned model's needs none of its
    packages: `model_cache`). Else a split GGUF is assembled and verified in a temp
    directory beside the cache and deleted once converted.
    """
    target = converted_dir(packaged, cache_dir)
    if is_converted(target):
        return target
    if packaged.sha256 is None:
        _convert_gguf(packaged.part_paths()[0], target)
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.gguf.", dir=cache_dir) as tmp:
        _convert_gguf(assemble_gguf(packaged, Path(tmp)), target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize `gguf` to fp32 safetensors in `target`, atomically.

    Written into a sibling temp dir and renamed: a reader never sees a half
    directory, and when two processes convert at once the loser discards its copy.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to %s (one time: ~35 s for SmolLM2)", gguf.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        kwargs = {"gguf_file": gguf.name, "local_files_only": True}
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
        _drop_gguf_quantizer(model)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, **kwargs).save_pretrained(tmp)
        _publish(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def _drop_gguf_quantizer(model: PreTrainedModel) -> None:
    """Mark a fully dequantized GGUF model as a plain one so it can be saved.

    Without a matmul kernel (the CPU case) transformers unpacks every weight to
    a dense tensor but keeps the GGUF quantizer attached, which refuses to save.
    """
    packed = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    if packed:
        raise ValueError(f"GGUF weights still packed (e.g. {packed[0]}); cannot convert")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)


def _publish(tmp: Path, target: Path) -> None:
    tmp.chmod(0o755)  # mkdtemp creates it private; the cache is an ordinary directory
    try:
        os.rename(tmp, target)
    except OSError:
        # Another process renamed its finished copy first; keep theirs.
        if not is_converted(target):
            raise
        logger.info("%s was converted concurrently; discarding this copy", target)


def model_directory(config: ModelConfig) -> Path:
    """The local HF directory of `config.source` (converting the bundled GGUF once): what an
    engine such as vLLM is pointed at."""
    return _resolve_model_dir(config)


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
