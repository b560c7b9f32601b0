"""Factories for the approximate-mode policy tests: a 4-layer tiny Llama and a 2-agent chain."""

from __future__ import annotations

from helpers.client import make_tiny_llama
from helpers.text import CharTokenizer, FakePrompt, make_prompt
from kvsplice.client.execute.execution import GenerationConfig
from kvsplice.client.model.models import LoadedModel, bundle_model
from kvsplice.client.reuse_engine import CallOutcome, ReuseEngine

NUM_LAYERS = 4
GENERATION = GenerationConfig(max_new_tokens=6, stop_token_ids=(127,))
# Both systems end in the same 17 tokens, the left context the question shares.
SYSTEM_1 = "<|im_start|>system\nYou plan.<|im_end|>\n<|im_start|>user\nProblem:\n"
SYSTEM_2 = "<|im_start|>system\nYou solve.<|im_end|>\n<|im_start|>user\nProblem:\n"
SYSTEM_3 = "<|im_start|>system\nYou judge.<|im_end|>\n<|im_start|>user\nProblem:\n"
HANDOFF = "\nAgent 1 said:\n"
CLOSING = "\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\n"


def make_loaded4(seed: int = 0) -> LoadedModel:
    """4 layers, hidden 64, 4 query / 2 KV heads (GQA), fp32, over the character vocabulary."""
    return bundle_model(make_tiny_llama(seed=seed, num_layers=NUM_LAYERS), CharTokenizer())


def first_prompt(question: str, system: str = SYSTEM_1) -> FakePrompt:
    return make_prompt(
        [
            ("text", "text_0", system),
            ("placeholder", "user_question", question),
            ("text", "text_2", CLOSING),
        ]
    )


def second_prompt(question: str, upstream: tuple[int, ...]) -> FakePrompt:
    return make_prompt(
        [
            ("text", "text_0", SYSTEM_2),
            ("placeholder", "user_question", question),
            ("text", "text_2", HANDOFF),
            ("placeholder", "agent_1_current", upstream),
            ("text", "text_4", CLOSING),
        ]
    )


def run_chain(engine: ReuseEngine, question: str) -> list[tuple[FakePrompt, CallOutcome]]:
    """Agent 1 sees the question; agent 2 the question and agent 1's answer (as ids)."""
    prompt_1 = first_prompt(question)
    first = engine.run(prompt_1, GENERATION)
    prompt_2 = second_prompt(question, first.output_ids or (32,))
    return [(prompt_1, first), (prompt_2, engine.run(prompt_2, GENERATION))]


def approximate_tokens(outcome: CallOutcome) -> int:
    """Reused tokens that did not come from an exact left-context match."""
    return sum(span.num_tokens for span in outcome.reused if not span.exact)
