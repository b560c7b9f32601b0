"""The first-form demo's invariants on SmolLM2 (slow) and `bench core` on a tiny model (fast)."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvsplice.client.models import LoadedModel, ModelConfig, bundle_model, load_model_cached
from kvsplice.eval.bench_core import render_core_bench, run_core_bench
from kvsplice.eval.core_demo import (
    CoreDemoConfig,
    build_agent_prompts,
    render_core_demo,
    run_core_demo,
    shared_prefix_len,
)


def make_tiny_loaded() -> LoadedModel:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
    )  # fmt: skip
    vocab = {f"w{i}": i for i in range(64)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w0"))
    )
    return bundle_model(LlamaForCausalLM(config).eval(), tokenizer)


def render(table: object) -> str:
    console = Console(width=240, record=True)
    console.print(table)
    return console.export_text()


def test_shared_prefix_len_stops_at_the_first_difference() -> None:
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert shared_prefix_len([[7, 8], [7, 8]]) == 2


def test_bench_core_rows_on_a_tiny_model() -> None:
    rows = run_core_bench(make_tiny_loaded(), lengths=(8, 16), repeats=1)
    assert [row.num_tokens for row in rows] == [8, 16]
    for row in rows:
        assert row.kv_nbytes == 2 * 2 * 2 * row.num_tokens * 8 * 4  # K+V, L, H_kv, T, D, fp32
        assert min(row.dense_prefill_s, row.reuse_s, row.dequant_shift_s, row.memcpy_s) > 0
    assert "16" in render(render_core_bench(rows))


def test_bench_core_rejects_empty_lengths() -> None:
    with pytest.raises(ValueError, match="lengths"):
        run_core_bench(make_tiny_loaded(), lengths=())


@pytest.mark.slow
def test_core_demo_reuse_is_exact_and_timed() -> None:
    loaded = load_model_cached(ModelConfig())
    prompts = build_agent_prompts(loaded, CoreDemoConfig().question)
    result = run_core_demo(loaded, CoreDemoConfig(repeats=1))
    assert result.producer_role == "planner"
    assert [run.role for run in result.runs] == ["solver", "critic"]
    assert result.shared_prefix_tokens == shared_prefix_len(list(prompts.values())) > 200
    for run in result.runs:
        assert run.reused_tokens == result.shared_prefix_tokens < run.prompt_tokens
        assert run.greedy_match
        assert run.max_abs_logit_delta <= 1e-4
        assert run.dense_ttft_s > 0 and run.reuse_ttft_s > 0
    assert "solver" in render(render_core_demo(result))
