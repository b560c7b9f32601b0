"""The first-form demo's invariants on SmolLM2 (slow) and `bench core` on a tiny model (fast)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from rich.console import Console
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvsplice.client.models import LoadedModel, ModelConfig, bundle_model, load_model_cached
from kvsplice.eval.bench_core import (
    CoreBenchRow,
    core_bench_to_json,
    render_core_bench,
    run_core_bench,
)
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
    rows = run_core_bench(make_tiny_loaded(), lengths=(8, 16), repeats=1, thread_counts=(1, 2))
    assert [(row.num_tokens, row.num_threads) for row in rows] == [(8, 1), (8, 2), (16, 1), (16, 2)]
    for row in rows:
        assert row.kv_nbytes == 2 * 2 * 2 * row.num_tokens * 8 * 4  # K+V, L, H_kv, T, D, fp32
        assert min(row.dense_prefill_s, row.reuse_s, row.decode_s, row.memcpy_s) > 0
        assert row.targets_met is None  # targets are stated at 1,024 tokens
    assert "16" in render(render_core_bench(rows))
    data = json.loads(json.dumps(core_bench_to_json(rows)))
    first = data["rows"][0]
    assert (first["num_tokens"], first["num_threads"]) == (8, 1)
    assert first["decode_ratio_to_memcpy"] == pytest.approx(rows[0].decode_ratio_to_memcpy)
    assert first["reuse_speedup_vs_dense"] == pytest.approx(rows[0].reuse_speedup_vs_dense)


def test_core_targets_are_judged_at_1024_tokens() -> None:
    row = CoreBenchRow(1024, 1, 1, 8, dense_prefill_s=4.0, reuse_s=0.1, decode_s=0.02,
                       two_step_decode_s=0.1, memcpy_s=0.01)  # fmt: skip
    assert row.reuse_speedup_vs_dense == pytest.approx(40.0) and row.targets_met
    assert not replace(row, decode_s=0.021).targets_met
    assert not replace(row, reuse_s=0.11).targets_met


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
