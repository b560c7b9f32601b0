"""The reuse-policy interface: the prompts it plans for, the context it plans in, what it returns.

Owns `ReusePolicy`, the prompt protocols the client accepts (the agents'
`RenderedPrompt` satisfies them), `span_role`, `CallContext`/`StoreContext` (what a
policy may use during one call; the engine builds one per call and nothing changes it
after), `PlannedCall` (what `plan` returns and `after_call` gets back), `ModeSpec` and
`PlanBuilder`. The rules of each mode live in their own modules; what several share in
`shared`; storing after a call in `recorder`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Generic, Literal, Protocol, TypeVar

import torch

from kvsplice.client.execute.call_executor import CallExecutor
from kvsplice.client.execute.execution import CallTimings, ExecutionState
from kvsplice.client.execute.layerwise_executor import LayerwiseResult
from kvsplice.client.execute.plan import CallPlan, NamedRange, PlanSpan, Source
from kvsplice.client.tiers.local_tier import LocalTier
from kvsplice.client.tiers.segment_io import SegmentSink, SpanRecord
from kvsplice.common.errors import LayoutMismatch
from kvsplice.kvmath.payload import KVSource
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.storeclient.client import StoreClient

logger = logging.getLogger(__name__)

SpanRole = Literal["question", "agent_output", "condition", "text"]
QUESTION_BLOCK = "question"  # the id `reused_blocks` gives the question's blocks


class PromptSpan(NamedRange, Protocol):
    """Tokens [start, end) of a prompt from one template part ("text" or "placeholder")."""

    @property
    def kind(self) -> str: ...


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


@dataclass(frozen=True)
class CallContext:
    """What a policy may use during one call (built by the engine per call, never changed).

    `executor` runs plans of both kinds (its `layerwise` loop for approximate
    ones); `rope` moves keys; `decode_dtype`: what fetched payloads decode to
    (fp32: shift first, cast once). An engine without a store hands its policies
    this; with one, a `StoreContext`. What a policy planned comes back to it as
    its `PlannedCall`; what the run produced, as the `ExecutionState` `after_call` gets.
    """

    fingerprint: str
    executor: CallExecutor
    rope: RopeSpec
    decode_dtype: torch.dtype
    timings: CallTimings
    decode_text: Callable[[Sequence[int]], str]
    encode_text: Callable[[str], tuple[int, ...]]
    quant: str


@dataclass(frozen=True)
class StoreContext(CallContext):
    """A call's context on an engine with a store; code that looks segments up or puts
    them takes this one (without a store there is nothing to find and nowhere to put).

    `local`: the worker's decoded tier (0 bytes: none). `writer`: where `RecordingPolicy`
    hands the call's segments (the engine's `SegmentWriter` thread, or `DirectPuts`).
    """

    store: StoreClient
    local: LocalTier
    writer: SegmentSink

    @classmethod
    def of(
        cls, ctx: CallContext, store: StoreClient, local: LocalTier, writer: SegmentSink
    ) -> StoreContext:
        """`ctx` (a plain `CallContext`) with the engine's store, tier and writer."""
        return cls(**vars(ctx), store=store, local=local, writer=writer)


Memo = TypeVar("Memo")


@dataclass(frozen=True, eq=False)
class PlannedCall(Generic[Memo]):
    """One call's plan and what the policy leaves with it; immutable once returned.

    result: `plan`'s run through the decoder layers when the policy already ran it (to
    test it); the executor continues from it instead of running `plan` again (None: not run).
    records: K/V the policy computed while planning (a placeholder's standalone base),
    put by its `after_call` after the first token, before the call's own segments.
    decisions: what it decided and why, for the call's outcome (e.g.
    {"anchor_gate": "ambiguous"}, {"halo_acceptance": "rejected"}).
    memo: what `plan` leaves for the policy's own `after_call` (None: nothing).
    """

    plan: CallPlan
    result: LayerwiseResult | None = None
    records: tuple[SpanRecord, ...] = ()
    decisions: Mapping[str, str] = field(default_factory=dict)
    memo: Memo | None = None

    def __post_init__(self) -> None:
        # NOTE: a read-only copy, so neither the policy nor the engine can change a
        # planned call's decisions after the fact (the dataclass is frozen, a dict is not).
        object.__setattr__(self, "decisions", MappingProxyType(dict(self.decisions)))


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


def reused_blocks(prompt: SpannedPrompt, *, question: bool = False) -> tuple[CandidateBlock, ...]:
    """The blocks a judge mode reuses by content: the candidate blocks, and with `question`
    the question's placeholders too (id "question"), in prompt order."""
    blocks = candidate_blocks(prompt)
    if question:
        blocks += tuple(
            CandidateBlock(QUESTION_BLOCK, span.start, span.end)
            for span in prompt.spans
            if span_role(span) == "question" and span.end > span.start
        )
    return tuple(sorted(blocks, key=lambda b: b.start))


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
        segment: KVSource,
        mode: str,
        *,
        exact: bool,
        chain_key: bytes | None = None,
        chain_num_tokens: int = 0,
        name: str = "",
        decoded: bool = False,
    ) -> None:
        """Read every layer of `segment` at slots [start, start + T), its keys moved by Δ
        (`decoded`: a stored response's K/V, see `Source`)."""
        if start < self.covered_until:
            raise ValueError(
                f"reuse at {start} overlaps the previous one (ends {self.covered_until})"
            )
        if segment.layer_start != 0:
            raise LayoutMismatch(f"segment starts at layer {segment.layer_start}, not 0")
        delta = start - segment.start_position
        source = Source(mode, exact, start, delta, chain_key, chain_num_tokens, decoded=decoded)
        self._reused.append(PlanSpan(
            start, start + segment.num_tokens, segment.num_layers, segment,
            name=name, delta=delta, source=source,
        ))  # fmt: skip

    def build(self) -> CallPlan:
        """Gaps computed; a reuse reaching the last token gives that token up."""
        return CallPlan.tiled(self._token_ids, self._reused)
