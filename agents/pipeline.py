"""Running an agent graph on one question with a reuse engine, call by call.

Owns `run_pipeline`, `AgentCall` and `PipelineTrace`: it resolves each step's
fills (the question as text, upstream answers as their generated ids), renders
the prompt and hands it to the engine. Reuse decisions are the engine's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from kvsplice.agents.graph import AgentGraph, AgentStep, AnswerRef, QuestionRef
from kvsplice.agents.render import PlaceholderValue, RenderedPrompt, Tokenizer, render
from kvsplice.client.execute.execution import GenerationConfig
from kvsplice.client.reuse_engine import CallOutcome, ReuseEngine

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class AgentCall(CallOutcome):
    """One agent's call: the engine's `CallOutcome`, and which agent made it with what.

    `text` is the decoded answer (special tokens skipped); ttft_s runs from when the
    agent had its inputs (before rendering) to its first token; num_reused_tokens /
    num_prompt_tokens is its token reuse rate.
    """

    agent_id: str
    round: int
    prompt: RenderedPrompt
    generation: GenerationConfig

    @property
    def reuse_rate(self) -> float:
        return self.num_reused_tokens / self.num_prompt_tokens


@dataclass(frozen=True)
class Sampling:
    """Sampled decoding for a pipeline's calls: softmax(logits / temperature), seeded."""

    temperature: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature {self.temperature} must be > 0 (0 is greedy: None)")


@dataclass
class PipelineTrace:
    """All calls of one question, in execution order; the last call's text is the answer."""

    question: str
    graph_name: str
    mode: str
    calls: list[AgentCall]

    @property
    def final_answer(self) -> str:
        return self.calls[-1].text


def run_pipeline(
    graph: AgentGraph,
    question: str,
    engine: ReuseEngine,
    *,
    ignore_stop: bool = False,
    max_new_tokens: int | None = None,
    on_call: Callable[[AgentCall], None] | None = None,
    sampling: Sampling | None = None,
) -> PipelineTrace:
    """Run every step of `graph` on `question`, greedy unless `sampling` is given.

    Each agent stops at its role's `max_new_tokens` (or `max_new_tokens`, when
    given, for all agents), at EOS or at its chat turn-end marker; with
    `ignore_stop` it generates exactly that many tokens. `on_call` sees each call
    as it finishes (progress reporting). `sampling`: every call samples at its
    temperature, call i seeded with its seed + i (reproducible, and the agents'
    draws independent).
    """
    tokenizer: Tokenizer = engine.loaded.tokenizer
    answers: dict[tuple[str, int], tuple[int, ...]] = {}
    calls: list[AgentCall] = []
    for index, step in enumerate(graph):
        drawn = None if sampling is None else replace(sampling, seed=sampling.seed + index)
        call = _run_step(
            step, question, answers, engine, tokenizer, ignore_stop, max_new_tokens, drawn
        )
        answers[(step.agent_id, step.round)] = call.output_ids
        calls.append(call)
        if on_call is not None:
            on_call(call)
    return PipelineTrace(question, graph.name, engine.mode, calls)


def _run_step(
    step: AgentStep,
    question: str,
    answers: dict[tuple[str, int], tuple[int, ...]],
    engine: ReuseEngine,
    tokenizer: Tokenizer,
    ignore_stop: bool,
    max_new_tokens: int | None,
    sampling: Sampling | None,
) -> AgentCall:
    started_at_s = time.perf_counter()
    values = {name: _resolve(ref, question, answers) for name, ref in step.fills.items()}
    prompt = render(step.role.template, values, tokenizer)
    generation = GenerationConfig(
        max_new_tokens=max_new_tokens or step.role.max_new_tokens,
        stop_token_ids=stop_token_ids(tokenizer, step.role.chat.turn_end),
        ignore_stop=ignore_stop,
        temperature=0.0 if sampling is None else sampling.temperature,  # 0: greedy
        seed=None if sampling is None else sampling.seed,
    )
    outcome = engine.run(prompt, generation, started_at_s=started_at_s)
    text = engine.loaded.decode(outcome.output_ids, skip_special_tokens=True)
    return _agent_call(step, prompt, outcome, generation, text)


def _resolve(
    ref: QuestionRef | AnswerRef, question: str, answers: dict[tuple[str, int], tuple[int, ...]]
) -> PlaceholderValue:
    if isinstance(ref, QuestionRef):
        return question
    return answers[(ref.agent_id, ref.round)]


def stop_token_ids(tokenizer: Tokenizer, turn_end: str) -> tuple[int, ...]:
    """EOS and the chat turn-end marker, when it is a single token."""
    ids = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    marker = tokenizer.encode(turn_end, add_special_tokens=False)
    if len(marker) == 1:
        ids.add(int(marker[0]))
    return tuple(sorted(ids))


def _agent_call(
    step: AgentStep,
    prompt: RenderedPrompt,
    outcome: CallOutcome,
    generation: GenerationConfig,
    text: str,
) -> AgentCall:
    fields = {f.name: getattr(outcome, f.name) for f in dataclasses.fields(outcome)}
    fields["text"] = text
    return AgentCall(
        **fields, agent_id=step.agent_id, round=step.round, prompt=prompt, generation=generation
    )
