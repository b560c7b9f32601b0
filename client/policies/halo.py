"""Mode `halo` (EPIC's LegoLink, seed 004): naive's reuse with each span's first h tokens computed.

Naive's plan decides what is reused; every approximate span's first h tokens
are computed against the true left context (`halo_plan`) and the rest is read
at every layer. With an acceptance config, the boundary KL test runs before the
first token (its runs are in the TTFT): accepted → its probed run is the call's
prefill; rejected → the call is dense past the exact prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.client.call_timings import timed
from kvsplice.client.layerwise import LayerwisePlan
from kvsplice.client.modes.halo import halo_plan
from kvsplice.client.modes.halo_acceptance import AcceptanceConfig, check_acceptance, probed_plan
from kvsplice.client.policies.base import CallContext, SpannedPrompt
from kvsplice.client.policies.layerwise_call import LayerwiseCall, reuse_spans, whole_span_records
from kvsplice.client.policies.naive import NaivePolicy
from kvsplice.client.policies.recorder import call_records, put_records
from kvsplice.client.reuse_plan import Compute, PlannedSpan, Reuse, ReusePlan
from kvsplice.client.span_executor import ExecutionState

logger = logging.getLogger(__name__)

MODE = "halo"


@dataclass(frozen=True)
class HaloConfig:
    """num_halo h: tokens recomputed at the start of each approximate span (EPIC: k ≤ 32).

    acceptance: the boundary KL test (None: reuse without testing).
    """

    num_halo: int = 4
    acceptance: AcceptanceConfig | None = None

    def __post_init__(self) -> None:
        if self.num_halo < 0:
            raise ValueError(f"num_halo {self.num_halo} must be >= 0")


class HaloPolicy:
    mode = MODE

    def __init__(self, config: HaloConfig | None = None) -> None:
        self.config = config or HaloConfig()

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> ReusePlan | LayerwiseCall:
        naive = NaivePolicy().plan(prompt, ctx)
        if all(isinstance(s.action, Reuse) and s.action.exact for s in naive.reused_spans):
            return naive  # exact reuse or nothing: no junction to repair
        assert ctx.rope is not None and ctx.layerwise_executor is not None
        executor = ctx.layerwise_executor()
        spans, sources = reuse_spans(
            naive, ctx.rope, executor.num_layers, approx_start_layer=executor.num_layers, mode=MODE
        )  # fmt: skip
        exact_names = {name for name, source in sources.items() if source.action.exact}
        reused = LayerwisePlan(naive.token_ids, tuple(spans))
        plan = halo_plan(reused, self.config.num_halo, exact_names)
        acceptance = self.config.acceptance
        if acceptance is None:
            return LayerwiseCall(plan, sources)
        with timed(ctx.timings, "prefill_s"):
            verdict = check_acceptance(executor, plan, acceptance, exact_names)
        ctx.decisions["halo_acceptance"] = "accepted" if verdict.accepted else "rejected"
        if not verdict.accepted:
            logger.debug(
                "halo rejected: boundary KL %s > %s", verdict.kl_nats, acceptance.epsilon_nats
            )
            return exact_only(naive)
        probed, _ = probed_plan(plan, acceptance.num_probe, exact_names)
        return LayerwiseCall(probed, sources, result=verdict.reuse)

    def after_call(
        self,
        prompt: SpannedPrompt,
        plan: ReusePlan,
        state: ExecutionState,
        ctx: CallContext,
        response_ids: Sequence[int],
    ) -> None:
        records = call_records(prompt, plan, state, ctx, response_ids)
        put_records(ctx, whole_span_records(records, prompt.spans))


def exact_only(plan: ReusePlan) -> ReusePlan:
    """`plan` with every approximate reuse computed instead (the dense fallback)."""
    spans = tuple(
        PlannedSpan(s.start, s.end, Compute(), s.name)
        if isinstance(s.action, Reuse) and not s.action.exact
        else s
        for s in plan.spans
    )
    return ReusePlan(plan.token_ids, spans)
