"""sdpa_fp32: a bf16 model's attention in float32 gives one answer whatever the chunking.

Oracles on a tiny random Qwen2 (q/k/v biases, GQA) in bf16: a prefill in two chunks
(a cache, then the rest) equals one whole prefill, and an exact splice through the
executor equals dense; the float32 model's logits bound both. (At this size plain bf16
SDPA passes too; the real-model oracle, test_exact_oracle_qwen2, shows where it does not.
What fails here without this module's mask registration: a cached chunk's queries.)
"""

from __future__ import annotations

import pytest
import torch
import transformers
from model_factories import VOCAB, make_prompt, make_word_tokenizer
from transformers import DynamicCache

from kvsplice.client.execute.call_executor import CallExecutor
from kvsplice.client.execute.call_timings import CallTimings
from kvsplice.client.execute.capture import capture_segments
from kvsplice.client.execute.plan import CallPlan, segment_span
from kvsplice.client.model.fp32_attention import SDPA_FP32
from kvsplice.client.model.hf_cache import cache_kwarg
from kvsplice.client.model.models import ATTN_IMPLEMENTATIONS, LoadedModel, bundle_model

NUM_TOKENS, CUT = 40, 17


def make_tiny_qwen2(dtype: torch.dtype, attn: str) -> LoadedModel:
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attn_implementation=attn,
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # biases are zero at init: make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return bundle_model(model.to(dtype), make_word_tokenizer())


def whole_and_chunked(loaded: LoadedModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Last-token logits [V] of one prefill, and of a prefill of ids[:CUT] then the rest."""
    model = loaded.model
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        whole = model(torch.tensor([ids])).logits[0, -1].float()
        model(torch.tensor([ids[:CUT]]), **cache_kwarg(model, cache))
        positions = torch.arange(CUT, len(ids)).unsqueeze(0)
        rest = model(torch.tensor([ids[CUT:]]), position_ids=positions, **cache_kwarg(model, cache))
    return whole, rest.logits[0, -1].float()


def test_sdpa_fp32_is_a_model_config_choice() -> None:
    assert SDPA_FP32 in ATTN_IMPLEMENTATIONS


def test_chunked_prefill_equals_whole_prefill_in_bf16() -> None:
    loaded = make_tiny_qwen2(torch.bfloat16, SDPA_FP32)
    reference, _ = whole_and_chunked(
        make_tiny_qwen2(torch.float32, "sdpa"), make_prompt(NUM_TOKENS)
    )
    whole, chunked = whole_and_chunked(loaded, make_prompt(NUM_TOKENS))
    assert torch.equal(whole, chunked)
    assert float((whole - reference).abs().max()) < 0.1  # bf16 weights, same model


@pytest.mark.parametrize("cut", [1, CUT, NUM_TOKENS - 1])
def test_exact_splice_equals_dense_in_bf16(cut: int) -> None:
    loaded = make_tiny_qwen2(torch.bfloat16, SDPA_FP32)
    ids = make_prompt(NUM_TOKENS)
    segment = capture_segments(loaded.model, ids[:cut], [(0, cut)]).segments[0]
    executor = CallExecutor(loaded.model, loaded.layout, loaded.rope)
    span = segment_span(segment, 0, start_layer=segment.num_layers)
    spliced = executor.prefill(CallPlan.tiled(ids, [span]), CallTimings()).logits_first
    dense = executor.prefill(CallPlan.all_compute(ids), CallTimings()).logits_first
    assert torch.equal(spliced, dense)
