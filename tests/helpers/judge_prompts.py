"""Judge prompts on the tiny Llama for the judge-mode tests (crossfix, gated): two agents' answers
compared under an instruction, and the checks those tests share."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from helpers.approx import CLOSING, GENERATION, SYSTEM_3, make_loaded4, run_chain
from helpers.text import FakePrompt, make_prompt
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.reuse_engine import CallOutcome, ReuseEngine
from kvsplice.server.embedded import EmbeddedStore, loopback_config

ATOL = 1e-4
QUESTION = "what is two plus two?"
QUESTIONS = ("what is two plus two?", "name a prime number above ten")
NEAR_DUPLICATE = "what is two plus two!"
SELECT = "\nSelect the agent whose answer is best. Selected agent id: "
CONTINUE = "\nUse their answers and answer again."
# A margin no first token reaches on the tiny model (the knob's upper bound): never kept.
NEVER_KEPT = 1e9


def answers(engine: ReuseEngine) -> list[tuple[int, ...]]:
    """Two agents answer (their responses land in the store as a pipeline's would)."""
    return [o.output_ids or (32,) for _, o in run_chain(engine, QUESTION)]


def comparing(answers: list[tuple[int, ...]], instruction: str) -> FakePrompt:
    return comparing_about(QUESTION, answers, instruction)


def comparing_about(question: str, answers: list[tuple[int, ...]], instruction: str) -> FakePrompt:
    parts: list[tuple[str, str, str | tuple[int, ...]]] = [
        ("text", "text_0", SYSTEM_3),
        ("placeholder", "user_question", question),
    ]
    for index, answer in enumerate(answers, 1):
        parts += [("text", f"head_{index}", f"\nAgent {index}:\n"),
                  ("placeholder", f"agent_{index}_current", answer)]  # fmt: skip
    parts.append(("text", "tail", instruction + CLOSING))
    return make_prompt(parts)


def judge(engine: ReuseEngine, instruction: str = SELECT) -> tuple[FakePrompt, CallOutcome]:
    prompt = comparing(answers(engine), instruction)
    return prompt, engine.run(prompt, GENERATION)


def candidate_token_layers(outcome: CallOutcome) -> int:
    return sum(s.num_tokens * s.num_layers for s in outcome.reused if not s.exact)


def same_as_dense(engine: ReuseEngine, prompt: FakePrompt, outcome: CallOutcome) -> bool:
    reference = engine.dense_reference(prompt, GENERATION)
    return (
        outcome.generated_ids == reference.generated_ids
        and float((outcome.logits_first - reference.logits_first).abs().max()) <= ATOL
    )


@dataclass(frozen=True)
class ChoicePrompt:
    """A prompt that declares the token ids its answer chooses among (a judge's choices)."""

    token_ids: tuple[int, ...]
    spans: tuple
    choice_ids: tuple[int, ...]


@pytest.fixture(scope="module")
def store_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An embedded store per test module."""
    with EmbeddedStore(loopback_config(str(tmp_path_factory.mktemp("xf") / "lmdb"))) as store:
        yield store.target


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    """The tiny 4-layer Llama the judge-mode tests run."""
    return make_loaded4()
