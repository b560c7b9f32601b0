"""Exact-mode oracle on SmolLM2: capture -> payload -> splice equals dense prefill.

Also reports (loosely asserts) the fidelity of int8 payloads: KL of next-token
distributions and top-1 agreement against dense, over the spliced prompts' suffixes.
"""

from __future__ import annotations

import pytest
import torch

from kvsplice.client.execute.call_executor import CallExecutor
from kvsplice.client.execute.capture import capture_segments
from kvsplice.client.execute.execution import CallTimings, GenerationConfig
from kvsplice.client.execute.plan import CallPlan, PlanSpan, tile_spans
from kvsplice.client.model.models import LoadedModel
from kvsplice.kvmath.payload import KVSource, decode_stored, encode_payload

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are a meticulous assistant in a team of agents. Read the task carefully, "
    "state your assumptions, and answer concisely with the final result on the last line."
)
QUESTIONS = (
    "What is 17 multiplied by 23?",
    "Name three primary colors.",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in one sentence.",
    "If a train travels 60 km in 45 minutes, what is its speed in km/h?",
    "Translate 'good morning' into French.",
    "List the planets closer to the sun than Earth.",
    "What is the capital of Australia?",
)


def make_prompt_ids(loaded: LoadedModel, question: str, system: str = SYSTEM) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    encoded = loaded.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    return list(encoded["input_ids"])


def make_prefix_segment(loaded: LoadedModel, ids: list[int], prefix: int, quant: str) -> KVSource:
    """Capture ids[:prefix] densely and store it in the payload format (as a splice reads it)."""
    captured = capture_segments(loaded.model, ids[:prefix], [(0, prefix)]).segments[0]
    data = encode_payload(captured, model_fingerprint=loaded.fingerprint, quant=quant)
    return decode_stored(data, expect_fingerprint=loaded.fingerprint)


def prefix_span(segment: KVSource) -> PlanSpan:
    """Every layer of `segment` read at slot 0 (it was captured there: Δ 0)."""
    return PlanSpan(0, segment.num_tokens, segment.num_layers, segment)


def prefill_and_greedy(
    loaded: LoadedModel, plan: CallPlan, num_new: int = 32
) -> tuple[torch.Tensor, list[int]]:
    """The executor's first-token logits [V] and `num_new` greedy tokens for `plan`."""
    executor = CallExecutor(loaded.model, loaded.layout, loaded.rope)
    state = executor.prefill(plan, CallTimings())
    executor.generate(state, GenerationConfig(num_new, ignore_stop=True), CallTimings())
    return state.logits_first, state.generated


def max_abs_logit_delta(
    loaded: LoadedModel, ids: list[int], segment: KVSource
) -> tuple[float, list[int]]:
    spliced, tokens = prefill_and_greedy(loaded, CallPlan.tiled(ids, [prefix_span(segment)]))
    dense, _ = prefill_and_greedy(loaded, CallPlan.all_compute(ids), num_new=1)
    return float((spliced - dense).abs().max()), tokens


@pytest.mark.parametrize("question", QUESTIONS[:3])
def test_exact_splice_matches_dense_logits_and_32_greedy_tokens(
    smollm2: LoadedModel, question: str
) -> None:
    ids = make_prompt_ids(smollm2, question)
    _, dense_tokens = prefill_and_greedy(smollm2, CallPlan.all_compute(ids))
    for prefix in (1, len(ids) // 2, len(ids) - 1):
        delta, tokens = max_abs_logit_delta(
            smollm2, ids, make_prefix_segment(smollm2, ids, prefix, "none")
        )
        assert delta <= 1e-4, f"prefix {prefix}: max |Δlogit| {delta}"
        assert tokens == dense_tokens, f"prefix {prefix}"


def suffix_log_probs(loaded: LoadedModel, ids: list[int], segment: KVSource | None) -> torch.Tensor:
    """Log-probabilities [S, V] at every position after `segment`'s, with it spliced at slot
    0 by the executor's decoder-layer loop (dense if None)."""
    spans = [] if segment is None else [prefix_span(segment)]
    reused = 0 if segment is None else segment.num_tokens
    plan = CallPlan(
        tuple(ids), tile_spans(len(ids), spans), logits_slots=tuple(range(reused, len(ids)))
    )
    executor = CallExecutor(loaded.model, loaded.layout, loaded.rope)
    return torch.log_softmax(executor.layerwise.run(plan).logits.double(), dim=-1)


def shared_prefix_len(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def test_int8_splice_stays_close_to_dense(smollm2: LoadedModel) -> None:
    kls, agree = [], []
    for question in QUESTIONS:
        ids = make_prompt_ids(smollm2, question)
        prefix = shared_prefix_len(ids, make_prompt_ids(smollm2, "Hello."))
        segment = make_prefix_segment(smollm2, ids, prefix, "int8")
        dense = suffix_log_probs(smollm2, ids, None)[prefix:]
        quant = suffix_log_probs(smollm2, ids, segment)
        kls.append((dense.exp() * (dense - quant)).sum(-1))
        agree.append(dense.argmax(-1) == quant.argmax(-1))
    kl, top1 = torch.cat(kls), torch.cat(agree).double()
    print(f"\nint8 splice vs dense over {len(kl)} suffix positions, {len(QUESTIONS)} prompts: "
          f"KL mean {kl.mean():.3e} max {kl.max():.3e}; top-1 agreement {top1.mean():.4f}")  # fmt: skip
    assert float(top1.mean()) >= 0.75
