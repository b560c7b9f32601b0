"""First-form demo: three agents share a system prompt and a question; two reuse the first's KV.

Owns the demo prompts, the dense-vs-reuse TTFT and fidelity measurements, and
their rich table. No store service yet: the shared prefix travels as payload
bytes from the producing agent to the consuming ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from rich.table import Table

from kvsplice.client.capture import capture_segments
from kvsplice.client.models import LoadedModel
from kvsplice.client.splice import (
    PrefillResult,
    SplicedSegment,
    dense_prefill,
    greedy_generate,
    prefill_with_segments,
)
from kvsplice.eval.stopwatch import median_seconds
from kvsplice.kvmath.payload import decode_payload, encode_payload

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are one member of a small team of AI agents that solves problems together. "
    "The team has three roles. The planner reads the task and writes a short numbered "
    "plan. The solver follows the plan and computes the answer, showing each step. The "
    "critic checks the solver's work for arithmetic slips, unit errors, unstated "
    "assumptions and answers that do not address the question, and then gives a verdict. "
    "Rules that apply to every role: be concise; never invent facts that are not in the "
    "task; when a quantity has units, keep the units in every step; when the task is "
    "ambiguous, say which reading you chose and why; prefer simple arithmetic that a "
    "reader can verify by hand; finish with one line that starts with 'Answer:' or "
    "'Verdict:'. Formatting: plain text, no tables, at most eight lines. The team is "
    "evaluated on correctness first, clarity second and brevity third. Earlier mistakes "
    "the team made include mixing up minutes and hours, dropping a factor of two when a "
    "trip goes there and back, and rounding too early. Avoid them."
)
QUESTION = (
    "A delivery van leaves the depot at 8:15 and drives 42 km to a warehouse at an average "
    "speed of 56 km/h. It spends 25 minutes unloading and returns by the same road at "
    "48 km/h. At what time is it back at the depot?"
)
ROLE_INSTRUCTIONS = {
    "planner": "Role: planner. Write the numbered plan for this task.",
    "solver": "Role: solver. Solve the task step by step and give the answer.",
    "critic": "Role: critic. Check a solution to this task and give a verdict.",
}


@dataclass(frozen=True)
class CoreDemoConfig:
    """Demo knobs: greedy length compared, timing repeats and the payload scheme."""

    question: str = QUESTION
    max_new_tokens: int = 24
    repeats: int = 3
    quant: str = "none"

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} must be >= 1")
        if self.repeats < 1:
            raise ValueError(f"repeats {self.repeats} must be >= 1")
        if self.quant not in ("none", "fp16", "int8"):
            raise ValueError(f"quant {self.quant!r} not in ('none', 'fp16', 'int8')")


@dataclass(frozen=True)
class AgentRun:
    """One consuming agent: dense vs reuse TTFT (prefill + first token) and fidelity."""

    role: str
    prompt_tokens: int
    reused_tokens: int
    dense_ttft_s: float
    reuse_ttft_s: float
    max_abs_logit_delta: float
    greedy_match: bool
    output_text: str

    @property
    def speedup(self) -> float:
        return self.dense_ttft_s / self.reuse_ttft_s


@dataclass(frozen=True)
class CoreDemoResult:
    """The producer's shared prefix and payload, and one `AgentRun` per consumer."""

    producer_role: str
    shared_prefix_tokens: int
    payload_nbytes: int
    store_s: float
    runs: tuple[AgentRun, ...]


def build_agent_prompts(loaded: LoadedModel, question: str) -> dict[str, list[int]]:
    """Token ids per role: shared system prompt and question, then the role's turn."""
    prompts = {}
    for role, instruction in ROLE_INSTRUCTIONS.items():
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
            {"role": "user", "content": instruction},
        ]
        encoded = loaded.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        prompts[role] = list(encoded["input_ids"])
    return prompts


def shared_prefix_len(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix common to all prompts."""
    length = 0
    for column in zip(*prompts, strict=False):  # stops at the shortest
        if any(token != column[0] for token in column):
            break
        length += 1
    return length


def run_core_demo(loaded: LoadedModel, config: CoreDemoConfig = CoreDemoConfig()) -> CoreDemoResult:
    """Capture the shared prefix from the first agent's prompt, splice it into the others."""
    prompts = build_agent_prompts(loaded, config.question)
    producer, *consumers = prompts
    prefix = shared_prefix_len(list(prompts.values()))
    store_s, payload = median_seconds(
        lambda: _store_prefix(loaded, prompts[producer], prefix, config.quant), config.repeats
    )
    runs = tuple(
        _run_agent(loaded, role, prompts[role], prefix, payload, config) for role in consumers
    )
    return CoreDemoResult(producer, prefix, len(payload), store_s, runs)


def _store_prefix(loaded: LoadedModel, ids: list[int], prefix: int, quant: str) -> bytes:
    # The producer's own dense pass yields the span; storing costs one encode.
    segment = capture_segments(loaded.model, ids, [(0, prefix)]).segments[0]
    return encode_payload(segment, model_fingerprint=loaded.fingerprint, quant=quant)


def _run_agent(
    loaded: LoadedModel,
    role: str,
    ids: list[int],
    prefix: int,
    payload: bytes,
    config: CoreDemoConfig,
) -> AgentRun:
    def reuse() -> PrefillResult:
        segment = decode_payload(payload, expect_fingerprint=loaded.fingerprint)
        spliced = SplicedSegment(segment, tuple(ids[:prefix]))
        return prefill_with_segments(loaded.model, ids, [spliced], loaded.layout, loaded.rope)

    def dense() -> PrefillResult:
        return dense_prefill(loaded.model, ids)

    dense_s, dense_state = median_seconds(_with_first_token(dense), config.repeats)
    reuse_s, reuse_state = median_seconds(_with_first_token(reuse), config.repeats)
    delta = float((reuse_state.logits_last - dense_state.logits_last).abs().max())
    dense_tokens = greedy_generate(loaded.model, ids, config.max_new_tokens, dense_state)
    reuse_tokens = greedy_generate(loaded.model, ids, config.max_new_tokens, reuse_state)
    text = loaded.tokenizer.decode(reuse_tokens, skip_special_tokens=True)
    return AgentRun(
        role, len(ids), prefix, dense_s, reuse_s, delta, dense_tokens == reuse_tokens, text
    )


def _with_first_token(prefill: Callable[[], PrefillResult]) -> Callable[[], PrefillResult]:
    """TTFT = prefill + picking the first token (the first decode step of greedy)."""

    def run() -> PrefillResult:
        state = prefill()
        int(torch.argmax(state.logits_last))
        return state

    return run


def render_core_demo(result: CoreDemoResult) -> Table:
    """A rich table of the consumers' TTFT, speedup and fidelity (the CLI prints it)."""
    table = Table(
        title=f"kvsplice core demo: {result.shared_prefix_tokens}-token prefix from the "
        f"{result.producer_role} ({result.payload_nbytes / 1e6:.2f} MB payload, "
        f"stored in {result.store_s * 1e3:.0f} ms)"
    )
    for column in ("agent", "prompt", "reused", "dense TTFT", "reuse TTFT", "speedup",
                   "max |Δlogit|", "greedy match", "reuse output"):  # fmt: skip
        table.add_column(column, overflow="fold")
    for run in result.runs:
        table.add_row(
            run.role, str(run.prompt_tokens), str(run.reused_tokens),
            f"{run.dense_ttft_s * 1e3:.1f} ms", f"{run.reuse_ttft_s * 1e3:.1f} ms",
            f"{run.speedup:.1f}x", f"{run.max_abs_logit_delta:.1e}",
            "yes" if run.greedy_match else "NO", run.output_text.strip()[:60],
        )  # fmt: skip
    return table
