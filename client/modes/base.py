"""The reuse-policy interface, the prompts it plans for, and plan assembly.

Owns `ReusePolicy`, the prompt protocols the client accepts (the agents'
`RenderedPrompt` satisfies them), `span_role` and `PlanBuilder`. The context a policy
works in is `call_context`'s, what its plan returns `planned_call`'s; the rules of each
mode live in their own modules; storing after a call in `recorder`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kvsplice.client.execute.execution import ExecutionState
from kvsplice.client.execute.plan import CallPlan, PlanSpan, Source
from kvsplice.client.modes.call_context import CallContext
from kvsplice.client.modes.planned_call import PlannedCall
from kvsplice.common.errors import LayoutMismatch
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

SpanRole = Literal["question", "agent_output", "condition", "text"]


class PromptSpan(Protocol):
    """Tokens [start, end) of a prompt from one template part ("text" or "placeholder")."""

    @property
    def kind(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...


class SpannedPrompt(Protocol):
    """Prompt token ids and the spans tiling them in order."""

    @property
    def token_ids(self) -> tuple[int, ...]: ...
    @property
    def spans(self) -> Sequence[PromptSpan]: ...


def span_role(span: PromptSpan) -> SpanRole:
    """What a span holds, from KVComm's placeholder names (the agents' template grammar)."""
    if span.kind != "placeholder":
        return "text"
    if span.name == "user_question":
        return "question"
    if span.name.startswith("agent_"):
        return "agent_output"
    return "condition"


class ReusePolicy(Protocol):
    """Decides a call's plan, and stores what the call produced once it is done.

    `plan` may run its plan already (to test it) and return it with its run.
    `after_call` gets the planned call back, and the run's state (what it
    reused per prompt range is `state.reuse`).
    """

    @property
    def mode(self) -> str: ...

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[Any]: ...

    def after_call(
        self,
        prompt: SpannedPrompt,
        planned: PlannedCall[Any],
        state: ExecutionState,
        ctx: CallContext,
        response_ids: Sequence[int],
    ) -> None: ...


@dataclass(frozen=True)
class ModeSpec:
    """One row of the mode table (`registry`): a mode's name, its `Params` type, its policy.

    build: the policy for given parameters. chain_only: its plans read the store
    through LookupPrefix and GetSegment alone (see the NOTE in `registry`).
    drifts: its outputs may differ from dense prefill (it must be admitted).
    ablation: an experiment's mode, never calibrated nor admitted by `kvsplice calibrate`.
    judge_capable: it preserves cross-candidate interaction, so calibration's judge probes
    may admit it for judge-like calls (the risk gate sends judges nowhere else).
    routes: built from a whole admission policy (`route(admission)`), not from `Params`:
    it runs, call by call, modes that policy admits (so it needs no admission itself).
    """

    name: str
    params_type: type
    build: Callable[[Any], ReusePolicy]
    chain_only: bool = False
    drifts: bool = True
    ablation: bool = False
    judge_capable: bool = False
    route: Callable[[Any], ReusePolicy] | None = None

    @property
    def routes(self) -> bool:
        return self.route is not None

    @property
    def calibrated(self) -> bool:
        """Whether `kvsplice calibrate` probes it on execution agents (a mode that drifts, not
        an ablation, a router or a judge mode: judge modes have judge probes of their own)."""
        return self.drifts and not self.ablation and not self.routes and not self.judge_capable

    def policy(self, params: Any = None) -> ReusePolicy:
        """The policy with `params` (None: the defaults)."""
        return self.build(self.params_type() if params is None else params)


@dataclass(frozen=True)
class CandidateBlock:
    """Tokens [start, end) of a prompt that hold the answer of agent `candidate_id`.

    A prompt's candidate blocks are its agent-output placeholders (what a judge
    weighs); the text before the first one is the prompt's shared prefix.
    """

    candidate_id: str
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"candidate block [{self.start}, {self.end}) is empty or negative")

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def candidate_blocks(prompt: SpannedPrompt) -> tuple[CandidateBlock, ...]:
    """The prompt's non-empty agent-output placeholders in prompt order, as candidate blocks.

    The id is the placeholder's agent id (`agent_<id>_current` → `<id>`), so a block
    keeps its candidate's identity under any display order.
    """
    return tuple(
        CandidateBlock(_agent_id(span.name), span.start, span.end)
        for span in prompt.spans
        if span_role(span) == "agent_output" and span.end > span.start
    )


def _agent_id(placeholder: str) -> str:
    return placeholder.removeprefix("agent_").rsplit("_", 1)[0]


class PlanBuilder:
    """Collects stored segments reused in prompt order and closes them into a `CallPlan`."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self._token_ids = tuple(int(t) for t in token_ids)
        self._reused: list[PlanSpan] = []

    @property
    def covered_until(self) -> int:
        """End of the last reused range (0 when none)."""
        return self._reused[-1].end if self._reused else 0

    def reuse(
        self,
        start: int,
        segment: SegmentKV,
        mode: str,
        *,
        exact: bool,
        chain_key: bytes | None = None,
        chain_num_tokens: int = 0,
        name: str = "",
    ) -> None:
        """Read every layer of `segment` at slots [start, start + T), its keys moved by Δ."""
        if start < self.covered_until:
            raise ValueError(
                f"reuse at {start} overlaps the previous one (ends {self.covered_until})"
            )
        if segment.layer_start != 0:
            raise LayoutMismatch(f"segment starts at layer {segment.layer_start}, not 0")
        delta = start - segment.start_position
        source = Source(mode, exact, start, delta, chain_key, chain_num_tokens)
        self._reused.append(PlanSpan(
            start, start + segment.num_tokens, segment.num_layers, segment.keys, segment.values,
            name=name, delta=delta, source=source,
        ))  # fmt: skip

    def build(self) -> CallPlan:
        """Gaps computed; a reuse reaching the last token gives that token up."""
        return CallPlan.tiled(self._token_ids, self._reused)
