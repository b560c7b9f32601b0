"""Mode `gated`: the admission policy as a worker runs it, with the judge risk gate above it.

Built from a whole admission policy (`from_admission`; its registry row routes). Every
call is classified first (`risk_gate.classify`). An ordinary call runs the policy's
serving mode. A judge-like call never runs an approximate mode that calibration did
not admit for judges: it runs the judge mode calibration admitted (an interaction-
preserving one), or `exact` — dense prefill after the exact prefix, zero drift. The
verdict and the route land in the call's decisions (`gated`, before the routed policy's
own). Each routed policy is built once and keeps its state across calls.

With a cost model (`JudgePricing`, calibrated), a judge-like call goes to the route
predicted cheapest among those that keep its decision — `exact`, the admitted judge mode
(its guard keeps the decision), `dense` — and never to one predicted slower than dense
(`route_cost.cheapest_route`); without one, to the admitted judge mode as before.

An `exact` judge is zero drift, yet in bf16 it is not the dense judge's computation: a
prompt prefilled from a reused prefix differs from one prefill by bf16 rounding (label
logits apart by up to ~0.04 on Qwen2.5-Coder-0.5B), and a judge that decides by less than
that can pick otherwise. So a judge-like call routed to `exact` on a reduced-precision model
that declares its choices is run first (the exact plan, its time counted) and kept when its
decision margin reaches the dtype's noise floor (`NOISE_FLOOR`); a closer call is prefilled
dense, the reference judge's own computation (`{"gated_exact": "dense: margin ..."}`).
The admitted judge mode's prefill gets the same floor over its own calibrated guard
(`{"gated_floor": ...}`): on Qwen a tenth of the judge calls decide by 0.01-0.05 logits,
and no approximate pass can keep such a call's choice but by luck. Where the machine
computes a split prompt bit for bit as one prefill (`determinism.splits_bitwise`), a staged
judge mode computes such a call on densely from its kept pass (`ResumesDense`): the same
computation as the dense judge's, without starting again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch

from kvsplice.client.execute.determinism import splits_bitwise
from kvsplice.client.execute.execution import ExecutionState, timed
from kvsplice.client.modes.base import (
    CallContext,
    ModeSpec,
    PlannedCall,
    ReusePolicy,
    SpannedPrompt,
    StoreContext,
    reused_blocks,
)
from kvsplice.client.modes.params import NoParams
from kvsplice.client.modes.risk_gate import classify
from kvsplice.client.modes.route_cost import (
    CostModel,
    JudgeShape,
    cheapest_route,
    dense_cost,
    exact_cost,
    staged_cost,
)
from kvsplice.client.modes.shared import decision_margin, declared_choices
from kvsplice.common.reuse_modes import DENSE, EXACT, GATED

logger = logging.getLogger(__name__)

MODE = GATED
# Zero-drift modes: a judge may run them whatever calibration said.
ZERO_DRIFT = (DENSE, EXACT)
GUARD = "gated_exact"
# The same floor over the admitted judge mode's kept prefill (its own guard may be lower).
FLOOR_GUARD = "gated_floor"
# Label-logit spread between two computations of one prompt (a reused prefix vs one
# prefill) per weight dtype, with the LM head in float32: bf16 up to 0.04 on Qwen2.5-
# Coder-0.5B's transcript judges (24 HumanEval sets, 2026-11-26), fp16 taken at a quarter
# of it (3 more mantissa bits: an eighth). float32 splices equal dense to ~1e-3: no guard.
NOISE_FLOOR = {torch.bfloat16: 0.05, torch.float16: 0.0125}


@runtime_checkable
class ResumesDense(Protocol):
    """A staged judge mode that can compute a kept call on densely from its kept pass
    (crossfix): None when it cannot give dense prefill's computation bit for bit."""

    def dense_from(
        self, planned: PlannedCall[Any], ctx: CallContext
    ) -> PlannedCall[Any] | None: ...


@dataclass(frozen=True)
class Route:
    """Where the gate sent one call, and why (the call's `risk_gate` decision); `judge`:
    the call was judge-like."""

    mode: str
    reason: str
    judge: bool = False


@dataclass(frozen=True)
class JudgePricing:
    """How the gate prices a judge call's routes: the calibrated `cost` model, and the
    judge mode's passes (`checks`, cheapest first) with the share of calls each keeps once
    reached (`keep`; calibration's judge probes; a missing share counts as 0), and the
    share of answer tokens it still computes above each check layer (`ratio`); `question`:
    whether it reuses the question as it does the answers (crossfix's `q`)."""

    cost: CostModel
    checks: tuple[int, ...] = ()
    keep: tuple[float, ...] = ()
    ratio: float = 0.0
    question: bool = False

    def __post_init__(self) -> None:
        if any(not 0 <= k <= 1 for k in self.keep):
            raise ValueError(f"keep shares {self.keep} must lie in [0, 1]")
        if any(c < 0 for c in self.checks):
            raise ValueError(f"check layers {self.checks} must be >= 0")

    def predict(self, shape: JudgeShape, judge_mode: str | None) -> dict[str, float]:
        """Predicted seconds per route, zero-drift routes first (they win ties)."""
        prices = {EXACT: exact_cost(shape, self.cost), DENSE: dense_cost(shape, self.cost)}
        if judge_mode is not None and self.checks:
            prices[judge_mode] = staged_cost(shape, self.cost, self.checks, self.keep, self.ratio)
        return prices


def judge_shape(prompt: SpannedPrompt, ctx: CallContext, *, question: bool = False) -> JudgeShape:
    """The prompt's token counts and its stored exact prefix (one index lookup, no payload);
    with `question`, the question counts among the blocks the judge mode reads."""
    hit = 0
    if isinstance(ctx, StoreContext):
        with timed(ctx.timings, "lookup_s"):
            hit = ctx.store.lookup_prefix(ctx.fingerprint, prompt.token_ids).num_matched_tokens
    num_tokens = len(prompt.token_ids)
    hit = min(hit, num_tokens)
    blocks = reused_blocks(prompt, question=question)
    first = blocks[0].start if blocks else num_tokens
    answers = sum(max(0, b.end - max(b.start, hit)) for b in blocks)
    layers = ctx.executor.layerwise.num_layers
    return JudgeShape(num_tokens, layers, hit, first, answers)


@dataclass(frozen=True, eq=False)
class _Routed:
    """What the gate's `plan` leaves for its `after_call`: the policy it ran and its call."""

    policy: ReusePolicy
    planned: PlannedCall[Any]


class GatedPolicy:
    """`ordinary` serves ordinary calls; `judge` (None: `exact`) serves judge-like ones.

    `judge_admitted`: the modes calibration admitted for judges. A `judge` policy
    whose mode is neither zero-drift nor admitted is refused here, so no judge call
    can reach it. `pricing` (with `dense`, the dense policy): route each judge call by
    predicted cost (module docstring).
    """

    mode = MODE

    def __init__(
        self,
        ordinary: ReusePolicy,
        fallback: ReusePolicy,
        judge: ReusePolicy | None = None,
        judge_admitted: Sequence[str] = (),
        *,
        pricing: JudgePricing | None = None,
        dense: ReusePolicy | None = None,
    ) -> None:
        if fallback.mode not in ZERO_DRIFT:
            raise ValueError(f"the judges' fallback {fallback.mode!r} must be one of {ZERO_DRIFT}")
        if judge is not None and judge.mode not in (*ZERO_DRIFT, *judge_admitted):
            raise ValueError(f"mode {judge.mode!r} is not admitted for judges")
        self.ordinary = ordinary
        self.judge = judge or fallback
        self.fallback = fallback
        if pricing is not None and (dense is None or dense.mode != "dense"):
            raise ValueError("a priced gate needs the dense policy")
        self.pricing = pricing
        self.dense = dense

    def route(self, prompt: SpannedPrompt, ctx: CallContext) -> tuple[ReusePolicy, Route]:
        verdict = classify(prompt, ctx.decode_text)
        if not verdict.judge_like:
            policy = self.ordinary
            return policy, Route(policy.mode, f"ordinary ({verdict.reason}) -> {policy.mode}")
        if self.pricing is not None:
            return self._cheapest(prompt, ctx, verdict.reason)
        if self.judge is not self.fallback:
            policy = self.judge
            why = "admitted for judges"
        elif self.ordinary.mode in ZERO_DRIFT:
            policy = self.ordinary
            why = "zero drift"
        else:
            policy = self.fallback
            why = f"{self.ordinary.mode} not admitted for judges"
        reason = f"judge ({verdict.reason}) -> {policy.mode}: {why}"
        return policy, Route(policy.mode, reason, judge=True)

    def _cheapest(
        self, prompt: SpannedPrompt, ctx: CallContext, verdict: str
    ) -> tuple[ReusePolicy, Route]:
        assert self.pricing is not None and self.dense is not None
        judge_mode = None if self.judge is self.fallback else self.judge.mode
        prices = self.pricing.predict(
            judge_shape(prompt, ctx, question=self.pricing.question), judge_mode
        )
        mode = cheapest_route(prices)
        policy = {EXACT: self.fallback, DENSE: self.dense}.get(mode, self.judge)
        listed = ", ".join(f"{m} {s * 1e3:.0f}" for m, s in prices.items())
        return policy, Route(
            mode, f"judge ({verdict}) -> {mode}: cheapest (predicted ms: {listed})", judge=True
        )

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[_Routed]:
        """The routed policy's planned call, the route first among its decisions."""
        policy, route = self.route(prompt, ctx)
        logger.debug("risk gate: %s", route.reason)
        planned = policy.plan(prompt, ctx)
        if route.judge and route.mode != DENSE and self.dense is not None:
            key = GUARD if route.mode == EXACT else FLOOR_GUARD
            policy, planned = self._guard_floor(prompt, ctx, policy, planned, key)
        decisions = {MODE: route.reason, **planned.decisions}
        return replace(planned, decisions=decisions, memo=_Routed(policy, planned))

    def _guard_floor(
        self,
        prompt: SpannedPrompt,
        ctx: CallContext,
        routed: ReusePolicy,
        planned: PlannedCall[Any],
        key: str,
    ) -> tuple[ReusePolicy, PlannedCall[Any]]:
        """A judge's routed prefill (exact, or the admitted judge mode's passes) kept when its
        margin clears the dtype's noise floor, else prefilled again densely: a decision that
        rounding can flip is taken from the reference judge's own computation. A staged
        mode's kept passes computed every layer below their check layer as dense prefill
        does; where this machine computes a split prompt bit for bit as one prefill
        (`splits_bitwise`), the call is computed on densely from there (`ResumesDense`),
        which is that same computation, instead of prefilled again from the start."""
        layerwise = ctx.executor.layerwise
        floor = NOISE_FLOOR.get(layerwise.adapter.model.dtype, 0.0)
        choices = declared_choices(prompt)
        if not floor or not choices:
            return routed, planned
        # asked at the first floored call, met or not, so a warm-up call pays the probe
        resumer = routed if isinstance(routed, ResumesDense) and splits_bitwise(layerwise) else None
        result = planned.result
        if result is None:
            with timed(ctx.timings, "prefill_s"):
                result = layerwise.run(planned.plan)
        margin = decision_margin(result.logits_last, choices)
        if margin >= floor:
            kept = {key: f"kept: margin {margin:.3f} >= {floor:g}", **planned.decisions}
            return routed, replace(planned, result=result, decisions=kept)
        tested = replace(planned, result=result)
        resumed = resumer.dense_from(tested, ctx) if resumer is not None else None
        if resumed is not None:
            why = {
                key: f"dense: margin {margin:.3f} < {floor:g}, computed on densely",
                **resumed.decisions,
            }
            return routed, replace(resumed, decisions=why)
        dense = self.dense
        assert dense is not None  # `plan` guards only with a dense policy
        redo = dense.plan(prompt, ctx)
        # the passes that ran first stay in the record (their time is in the TTFT)
        why = {
            key: f"dense: margin {margin:.3f} < {floor:g}, prefilled again",
            **planned.decisions,
            **redo.decisions,
        }
        return dense, replace(redo, decisions=why)

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
    @property
    def judge_pricing(self) -> JudgePricing | None: ...
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
        pricing=admission.judge_pricing,
        dense=admission.policy_of("dense"),
    )


SPEC = ModeSpec(MODE, NoParams, lambda _: _needs_admission(), route=from_admission)


def _needs_admission() -> ReusePolicy:
    raise ValueError(f"mode {MODE!r} is built from an admission policy, not from parameters")
