"""Generation: stop ids validated, the model's EOS ends a call by default, seeded sampling."""

from __future__ import annotations

import pytest
import torch
from helpers.client import make_loaded
from helpers.text import make_prompt

from kvsplice.client.execute.execution import GenerationConfig, TokenPicker, nucleus
from kvsplice.client.reuse_engine import ReuseEngine

PROMPT = make_prompt([("text", "user", "<|im_start|>user\nwhat is two plus two?<|im_end|>\n")])


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"stop_token_ids": ("<|im_end|>",)}, "'<|im_end|>'"),
        ({"stop_token_ids": "<|im_end|>"}, "'<|im_end|>'"),
        ({"stop_token_ids": (2, -1)}, "-1"),
        ({"forced_ids": (True,)}, "True"),
        ({"temperature": float("nan")}, "nan"),
        ({"temperature": -0.5}, "-0.5"),
        ({"top_p": 0.0}, "0.0"),
        ({"seed": -3}, "-3"),
    ],
)
def test_bad_generation_fields_are_refused_by_name(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named.replace("|", r"\|")):
        GenerationConfig(max_new_tokens=4, **fields)


def test_with_eos_adds_the_models_eos_unless_told_not_to() -> None:
    config = GenerationConfig(max_new_tokens=4, stop_token_ids=[5])  # a list is kept as a tuple
    assert config.with_eos((2, 5)).stop_token_ids == (5, 2)
    assert GenerationConfig(4, stop_at_eos=False).with_eos((2,)).stop_token_ids == ()
    assert GenerationConfig(4, ignore_stop=True).with_eos((2,)).stop_token_ids == ()


def test_a_call_stops_at_the_models_eos_by_default() -> None:
    loaded = make_loaded()
    engine = ReuseEngine(loaded, "dense")
    unstopped = engine.run(PROMPT, GenerationConfig(12, stop_at_eos=False)).generated_ids
    eos = unstopped[3]
    end = unstopped.index(eos)  # the first time greedy decoding emits it
    loaded.model.generation_config.eos_token_id = [eos]
    outcome = engine.run(PROMPT, GenerationConfig(12))
    assert outcome.generated_ids == unstopped[: end + 1] and outcome.output_ids == unstopped[:end]
    ignoring = engine.run(PROMPT, GenerationConfig(12, stop_at_eos=False))
    assert ignoring.generated_ids == unstopped


def test_seeded_sampling_repeats_and_greedy_is_the_default() -> None:
    engine = ReuseEngine(make_loaded(), "dense")
    greedy = engine.run(PROMPT, GenerationConfig(8, stop_at_eos=False))
    sampled = [
        engine.run(PROMPT, GenerationConfig(8, stop_at_eos=False, temperature=5.0, seed=s))
        for s in (7, 7, 8)
    ]
    assert sampled[0].generated_ids == sampled[1].generated_ids
    assert len({o.generated_ids for o in (greedy, *sampled)}) > 1
    # a nucleus this small holds only the most likely token: greedy, whatever the temperature
    narrow = GenerationConfig(8, stop_at_eos=False, temperature=5.0, top_p=1e-9, seed=1)
    assert engine.run(PROMPT, narrow).generated_ids == greedy.generated_ids


def test_draws_follow_the_tempered_distribution_within_the_nucleus() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    expected = torch.softmax(logits / 2.0, dim=-1)  # 0.455, 0.276, 0.167, 0.102
    picker = TokenPicker(GenerationConfig(1, temperature=2.0, seed=0))
    counts = torch.bincount(torch.tensor([picker.pick(logits) for _ in range(4000)]), minlength=4)
    assert torch.allclose(counts / 4000, expected, atol=0.03)
    kept = nucleus(expected, 0.7)  # 0.455 + 0.276 reaches 0.7: the two most likely tokens
    assert kept.tolist() == pytest.approx([expected[0].item(), expected[1].item(), 0.0, 0.0])
    top = TokenPicker(GenerationConfig(1, temperature=2.0, top_p=0.7, seed=0))
    assert {top.pick(logits) for _ in range(500)} == {0, 1}
