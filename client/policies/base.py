"""The reuse-policy interface, the per-call context a policy works in, and plan assembly.

Owns `ReusePolicy`, `CallContext`, the prompt protocols the client accepts (the
agents' `RenderedPrompt` satisfies them), `span_role` and `PlanBuilder`. The
rules of each mode live in their own modules; storing after a call in `recorder`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import torch

from kvsplice.client.call_timings import CallTimings
from kvsplice.client.layerwise import LayerwiseExecutor, LayerwiseResult
from kvsplice.client.local_tier import LocalTier
from kvsplice.client.policies.layerwise_call import LayerwiseCall
from kvsplice.client.reuse_plan import Compute, PlannedSpan, Reuse, ReusePlan
from kvsplice.client.segment_io import SegmentStore, SpanRecord, slice_segment
from kvsplice.client.segment_writer import SegmentWriter
from kvsplice.client.span_executor import ExecutionState, SpanExecutor
from kvsplice.kvmath.rope import RopeSpec

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


@dataclass
class CallContext:
    """What a policy may use during one call. `store` None means no store at all.

    `decode_dtype`: what fetched payloads decode to (fp32: shift first, cast once).
    `pending` collects K/V a policy computed while planning (e.g. a placeholder's
    standalone base cache); it is put after the first token, outside the TTFT.
    Layerwise modes: `rope` moves keys, `layerwise_executor()` builds (once) the
    executor, `layerwise_result` is the engine's run of a `LayerwiseCall`, and
    `notes` is what a policy's `plan` leaves for its `after_call` in this call;
    `decisions` what the policy decided and why, for the call's outcome (e.g.
    {"anchor_gate": "ambiguous"}, {"halo_acceptance": "rejected"}).
    `local`: the worker's decoded tier (looked at before the sidecar); `writer`: puts
    this call's segments in the background (None: synchronously, after the first token).
    """

    store: SegmentStore | None
    fingerprint: str
    executor: SpanExecutor
    decode_dtype: torch.dtype
    timings: CallTimings
    decode_text: Callable[[Sequence[int]], str]
    quant: str = "int8"
    pending: list[SpanRecord] = field(default_factory=list)
    rope: RopeSpec | None = None
    layerwise_executor: Callable[[], LayerwiseExecutor] | None = None
    layerwise_result: LayerwiseResult | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    decisions: dict[str, str] = field(default_factory=dict)
    encode_text: Callable[[str], tuple[int, ...]] | None = None
    local: LocalTier | None = None
    writer: SegmentWriter | None = None


class ReusePolicy(Protocol):
    """Decides a call's plan, and stores what the call produced once it is done.

    `after_call` gets the plan as run: for a `LayerwiseCall`, its `view`.
    """

    @property
    def mode(self) -> str: ...

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> ReusePlan | LayerwiseCall: ...

    def after_call(
        self,
        prompt: SpannedPrompt,
        plan: ReusePlan,
        state: ExecutionState,
        ctx: CallContext,
        response_ids: Sequence[int],
    ) -> None: ...


class PlanBuilder:
    """Collects reused ranges in prompt order and closes them into a valid `ReusePlan`."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self._token_ids = tuple(int(t) for t in token_ids)
        self._reused: list[PlannedSpan] = []

    @property
    def covered_until(self) -> int:
        """End of the last reused range (0 when none)."""
        return self._reused[-1].end if self._reused else 0

    def reuse(self, start: int, action: Reuse, name: str = "") -> None:
        if start < self.covered_until:
            raise ValueError(
                f"reuse at {start} overlaps the previous one (ends {self.covered_until})"
            )
        self._reused.append(PlannedSpan(start, start + action.num_tokens, action, name))

    def build(self) -> ReusePlan:
        """Gaps become `Compute`; a reuse reaching the last token gives that token up."""
        spans: list[PlannedSpan] = []
        cursor, last = 0, len(self._token_ids) - 1
        for span in self._reused:
            if span.start > cursor:
                spans.append(PlannedSpan(cursor, span.start, Compute()))
            trimmed = _without_token(span, last) if span.end > last else span
            if trimmed is not None:
                spans.append(trimmed)
            cursor = min(span.end, last)
        spans.append(PlannedSpan(cursor, len(self._token_ids), Compute()))
        return ReusePlan(self._token_ids, tuple(spans))


def _without_token(span: PlannedSpan, position: int) -> PlannedSpan | None:
    """`span` cut to end before `position` (None if nothing is left)."""
    if position <= span.start:
        return None
    assert isinstance(span.action, Reuse)
    segment = slice_segment(span.action.segment, 0, position - span.start)
    return PlannedSpan(span.start, position, replace(span.action, segment=segment), span.name)
