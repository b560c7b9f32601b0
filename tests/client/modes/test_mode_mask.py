"""Mode `mask` (block-diagonal ablation): each candidate block sees the shared prefix only."""

from __future__ import annotations

import pytest
import torch
from helpers.client import make_loaded
from helpers.text import CharTokenizer, FakePrompt, make_prompt

from kvsplice.client.execute.execution import CallTimings, GenerationConfig
from kvsplice.client.model.hf_cache import cache_kwarg, full_length_cache, read_layers
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.mask import MaskPolicy
from kvsplice.client.reuse_engine import EngineConfig, ReuseEngine
from kvsplice.kvmath.segment_kv import SegmentKV

ATOL = 1e-4  # fp32: the same computation in another summation order, or a RoPE shift
GENERATION = GenerationConfig(max_new_tokens=4, stop_token_ids=(127,))
PREFIX = "<|im_start|>system\nJudge.<|im_end|>\n<|im_start|>user\nQ: two plus two?\n"
CLOSING = "\nWhich agent?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return make_loaded()


@pytest.fixture(scope="module")
def engine(loaded: LoadedModel) -> ReuseEngine:
    return ReuseEngine(loaded, MaskPolicy(), None, EngineConfig(quant="none"))


def judge_prompt(answers: dict[str, str]) -> FakePrompt:
    parts: list[tuple[str, str, str | tuple[int, ...]]] = [("text", "text_0", PREFIX)]
    for i, (agent_id, answer) in enumerate(answers.items()):
        parts.append(("text", f"label_{i}", f"Agent {agent_id}:\n"))
        parts.append(("placeholder", f"agent_{agent_id}_current", answer))
    return make_prompt([*parts, ("text", "text_9", CLOSING)])


def standalone_kv(loaded: LoadedModel, tokens: tuple[int, ...], start: int, end: int):
    """K/V of tokens[start:end] from one dense forward of `tokens` alone."""
    cache = full_length_cache()
    ids = torch.tensor([list(tokens)])
    with torch.inference_mode():
        loaded.model(input_ids=ids, **cache_kwarg(loaded.model, cache), use_cache=True)
    return read_layers(cache, start, end)


def test_without_candidate_blocks_mask_equals_dense(engine: ReuseEngine) -> None:
    prompt = make_prompt([("text", "text_0", PREFIX), ("text", "text_9", CLOSING)])
    outcome = engine.run(prompt, GENERATION)
    reference = engine.dense_reference(prompt, GENERATION)
    assert outcome.num_reused_tokens == 0
    assert torch.equal(outcome.logits_first, reference.logits_first)


def test_one_block_right_after_the_prefix_equals_dense(engine: ReuseEngine) -> None:
    # the block's only left context is the prefix, as in dense prefill
    prompt = make_prompt(
        [("text", "text_0", PREFIX), ("placeholder", "agent_1_current", "four"),
         ("text", "text_9", CLOSING)]
    )  # fmt: skip
    outcome = engine.run(prompt, GENERATION)
    reference = engine.dense_reference(prompt, GENERATION)
    assert outcome.num_reused_tokens == len(prompt.token_ids) - len(CharTokenizer().encode(CLOSING))
    assert (outcome.logits_first - reference.logits_first).abs().max() <= ATOL
    assert outcome.generated_ids == reference.generated_ids


def test_each_block_is_its_standalone_prefill_after_the_prefix_rotated_into_place(
    loaded: LoadedModel, engine: ReuseEngine
) -> None:
    prompt = judge_prompt({"2": "it is four", "1": "five", "3": "4"})
    plan = MaskPolicy().plan(prompt, engine._context(CallTimings())).plan
    blocks = [s for s in prompt.spans if s.name.startswith("agent_")]
    prefix_len = blocks[0].start  # the judge's text and the first label
    reused = [s for s in plan.spans if s.source is not None]
    assert [(s.start, s.end) for s in reused] == [(0, prefix_len)] + [
        (b.start, b.end) for b in blocks
    ]
    assert plan.spans[-1].computed  # the last token is always computed
    for block, span in zip(blocks, reused[1:], strict=True):
        assert span.delta == block.start - prefix_len
        alone = prompt.token_ids[:prefix_len] + prompt.token_ids[block.start : block.end]
        keys, values = standalone_kv(loaded, alone, prefix_len, len(alone))
        assert span.start - span.delta == prefix_len  # stored at the prefix's end
        assert isinstance(span.kv, SegmentKV)
        assert (span.kv.keys - keys).abs().max() <= ATOL
        assert (span.kv.values - values).abs().max() <= ATOL


def test_a_block_cannot_attend_to_another_block(engine: ReuseEngine) -> None:
    context = engine._context(CallTimings())
    one = MaskPolicy().plan(judge_prompt({"1": "five", "2": "four"}), context).plan
    other = MaskPolicy().plan(judge_prompt({"1": "nine", "2": "four"}), context).plan
    # agent 1's answer differs, agent 2's block (same length before it) does not change
    # plan: prefix, block 1, its label computed, block 2, the rest computed
    second = [one.spans[3], other.spans[3]]
    assert one.spans[3].start == other.spans[3].start
    first_kv, second_kv = second[0].kv, second[1].kv
    assert isinstance(first_kv, SegmentKV) and isinstance(second_kv, SegmentKV)
    assert torch.equal(first_kv.keys, second_kv.keys)
    assert torch.equal(first_kv.values, second_kv.values)
