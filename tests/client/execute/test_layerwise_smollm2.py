"""Layerwise-executor oracles on the real SmolLM2 (30 layers, GQA 9/3, sdpa, fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvsplice.client.execute.capture import capture_segments
from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor
from kvsplice.client.execute.plan import CallPlan, PlanSpan, segment_span
from kvsplice.client.model.hf_cache import cache_kwarg
from kvsplice.client.model.models import LoadedModel

pytestmark = pytest.mark.slow

ATOL = 1e-4  # measured: 0.0 (bit-identical) for all-compute and multicut 0, 15, 30
TEXT = (
    "You are the critic in a team of agents. The solver proposed that 17 times 23 is 391. "
    "Check the arithmetic step by step, then state whether the answer is correct."
)


def make_ids(loaded: LoadedModel) -> tuple[int, ...]:
    messages = [{"role": "user", "content": TEXT}]
    encoded = loaded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    return tuple(encoded["input_ids"])


def dense_last_logits(loaded: LoadedModel, ids: tuple[int, ...]) -> torch.Tensor:
    with torch.inference_mode():
        out = loaded.model(
            input_ids=torch.tensor([ids]),
            **cache_kwarg(loaded.model, DynamicCache()),
            logits_to_keep=1,
        )
    return out.logits[0, -1].float()


def test_all_compute_equals_model_forward(smollm2: LoadedModel) -> None:
    ids = make_ids(smollm2)
    result = LayerwiseExecutor(smollm2.model).run(CallPlan.all_compute(ids))
    torch.testing.assert_close(
        result.logits_last, dense_last_logits(smollm2, ids), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("cut", [0, 15, 30])
def test_multicut_from_exact_boundary_equals_dense(smollm2: LoadedModel, cut: int) -> None:
    ids = make_ids(smollm2)
    start, end = 5, len(ids) - 8
    captured = capture_segments(smollm2.model, ids, [(start, end)], boundary_layers=[cut])
    segment = captured.segments[0]
    spans = (
        PlanSpan(0, start),
        segment_span(segment, start, start_layer=cut),
        PlanSpan(end, len(ids)),
    )
    result = LayerwiseExecutor(smollm2.model).run(CallPlan(ids, spans))
    dense = dense_last_logits(smollm2, ids)
    torch.testing.assert_close(result.logits_last, dense, atol=ATOL, rtol=0)
    assert int(result.logits_last.argmax()) == int(dense.argmax())
    assert result.num_computed[0] == len(ids) - (end - start if cut > 0 else 0)
