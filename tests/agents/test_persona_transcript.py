"""The persona-first layout at the token level (what `bench vllm --layout persona-first` sends)."""

from __future__ import annotations

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from kvsplice.eval.workloads.token_transcript import PERSONAS, PIPELINE_ROLES, PersonaTranscript


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_each_agent_starts_with_its_persona_and_quotes_the_earlier_answers(
    smollm2_tokenizer: PreTrainedTokenizerBase,
) -> None:
    transcript = PersonaTranscript(smollm2_tokenizer)
    task = "Write `add(a, b)` returning a + b."
    answer = tuple(smollm2_tokenizer.encode("def add(a, b):\n    return a + b"))
    (planner, first), (solver, second) = PIPELINE_ROLES[:2]
    one = transcript.prompt(planner, task, [], first)
    two = transcript.prompt(solver, task, [(planner, answer)], second)
    text = smollm2_tokenizer.decode(two)
    assert PERSONAS[solver] in text and f"The {planner} wrote:\ndef add(a, b)" in text
    assert text.index(PERSONAS[solver]) < text.index("Team conventions") < text.index(task)
    # exact reuse stops inside the system prompts: the shared context sits after them
    shared = smollm2_tokenizer.decode(one[: common_prefix(one, two)])
    assert "Team conventions" not in shared and len(one) > 300
