"""Mode `gated`: the admission policy as a worker runs it, with the judge risk gate above it.

Built from a whole admission policy (`from_admission`; its registry row routes). Every
call is classified first (`risk_gate.classify`). An ordinary call runs the policy's
serving mode. A judge-like call never runs an approximate mode that calibration did
not admit for judges: it runs the judge mode calibration admitted (an interaction-
preserving one), or `exact` — dense prefill after the exact prefix, zero drift. The
verdict and the route land in the call's decisions (`gated`, before the routed policy's
own). Each routed policy is built once and keeps its state across calls.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvsplice.client.execute.execution import ExecutionState
from kvsplice.client.modes.base import ModeSpec, ReusePolicy, SpannedPrompt
from kvsplice.client.modes.call_context import CallContext
from kvsplice.client.modes.params import NoParams
from kvsplice.client.modes.planned_call import PlannedCall
from kvsplice.client.modes.risk_gate import classify

logger = logging.getLogger(__name__)

MODE = "gated"
# Zero-drift modes: a judge may run them whatever calibration said.
ZERO_DRIFT = ("dense", "exact")


@dataclass(frozen=True)
class Route:
    """Where the gate sent one call, and why (the call's `risk_gate` decision)."""

    mode: str
    reason: str


@dataclass(frozen=True, eq=False)
class _Routed:
    """What the gate's `plan` leaves for its `after_call`: the policy it ran and its call."""

    policy: ReusePolicy
    planned: PlannedCall[Any]


class GatedPolicy:
    """`ordinary` serves ordinary calls; `judge` (None: `exact`) serves judge-like ones.

    `judge_admitted`: the modes calibration admitted for judges. A `judge` policy
    whose mode is neither zero-drift nor admitted is refused here, so no judge call
    can reach it.
    """

    mode = MODE

    def __init__(
        self,
        ordinary: ReusePolicy,
        fallback: ReusePolicy,
        judge: ReusePolicy | None = None,
        judge_admitted: Sequence[str] = (),
    ) -> None:
        if fallback.mode not in ZERO_DRIFT:
            raise ValueError(f"the judges' fallback {fallback.mode!r} must be one of {ZERO_DRIFT}")
        if judge is not None and judge.mode not in (*ZERO_DRIFT, *judge_admitted):
            raise ValueError(f"mode {judge.mode!r} is not admitted for judges")
        self.ordinary = ordinary
        self.judge = judge or fallback
        self.fallback = fallback

    def route(self, prompt: SpannedPrompt, ctx: CallContext) -> tuple[ReusePolicy, Route]:
        verdict = classify(prompt, ctx.decode_text)
        if not verdict.judge_like:
            policy = self.ordinary
            return policy, Route(policy.mode, f"ordinary ({verdict.reason}) -> {policy.mode}")
        if self.judge is not self.fallback:
            policy = self.judge
            why = "admitted for judges"
        elif self.ordinary.mode in ZERO_DRIFT:
            policy = self.ordinary
            why = "zero drift"
        else:
            policy = self.fallback
            why = f"{self.ordinary.mode} not admitted for judges"
        return policy, Route(policy.mode, f"judge ({verdict.reason}) -> {policy.mode}: {why}")

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[_Routed]:
        """The routed policy's planned call, the route first among its decisions."""
        policy, route = self.route(prompt, ctx)
        logger.debug("risk gate: %s", route.reason)
        planned = policy.plan(prompt, ctx)
        decisions = {MODE: route.reason, **planned.decisions}
        return replace(planned, decisions=decisions, memo=_Routed(policy, planned))

    def after_call(
        self,
        prompt: SpannedPrompt,
        planned: PlannedCall[_Routed],
        state: ExecutionState,
        ctx: CallContext,
        response_ids: Sequence[int],
    ) -> None:
        routed = planned.memo
        assert routed is not None  # `plan` always routes
        routed.policy.after_call(prompt, routed.planned, state, ctx, response_ids)


class AdmittedModes(Protocol):
    """What the gate reads of an admission policy (`AdmissionPolicy` satisfies it)."""

    @property
    def serving_mode(self) -> str: ...
    @property
    def judge_modes(self) -> tuple[str, ...]: ...
    def policy_of(self, mode: str) -> ReusePolicy: ...


def from_admission(admission: AdmittedModes) -> GatedPolicy:
    """The gate over `admission`: its serving mode for ordinary calls, its first judge mode
    (or `exact`) for judge-like ones."""
    judges = admission.judge_modes
    return GatedPolicy(
        admission.policy_of(admission.serving_mode),
        admission.policy_of("exact"),
        admission.policy_of(judges[0]) if judges else None,
        judge_admitted=judges,
    )


SPEC = ModeSpec(MODE, NoParams, lambda _: _needs_admission(), route=from_admission)


def _needs_admission() -> ReusePolicy:
    raise ValueError(f"mode {MODE!r} is built from an admission policy, not from parameters")
