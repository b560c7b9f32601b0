"""Mode `halo` (EPIC's LegoLink, seed 004): naive's reuse with each span's first h tokens computed.

The position-only plan (`shared.plan_position_only`) decides what is reused;
every approximate span's first h tokens are computed against the true left
context (`halo_plan`) and the rest is read at every layer. With an acceptance bound, the boundary KL test runs before the
first token (its runs are in the TTFT): accepted → its probed run is the call's
prefill; rejected → the call is dense past the exact prefix.

Why: a span's K/V captured in another context carry that context's attention
sink and boundary; recomputing its first h tokens against the true left
context repairs the junction while the rest stays reused.

The boundary KL acceptance test (seed 004 §3.4, made precise). Probes: the last m tokens of every approximately reused span are computed
(a trailing halo) and their next-token distributions taken, so they attend
to the reused K/V before them in the span.
- reuse side: the plan with probes (its run is the one to keep if accepted);
- reference: the same tokens up to the last probe, with every approximate
  span computed densely against the true left context (exact spans stay
  reused), truncated after the last probe.
Accept iff KL(reference ‖ reuse) ≤ ε nats for a strict majority of probes.
Cost: the reference recomputes every approximate token up to the last probe,
i.e. the compute the reuse saved on this call; its verdict is worth keeping
per (segment, context) for later calls, or sampling (audits, calibration).
"""

from __future__ import annotations

import logging
from collections.abc import Container, Sequence
from dataclasses import dataclass

import torch

from kvsplice.client.execute.execution import timed
from kvsplice.client.execute.layerwise_executor import LayerwiseExecutor, LayerwiseResult
from kvsplice.client.execute.plan import CallPlan, PlanSpan, computed_span, slice_span
from kvsplice.client.modes.base import CallContext, ModeSpec, PlannedCall, SpannedPrompt
from kvsplice.client.modes.params import check_ranges, knob
from kvsplice.client.modes.recorder import WholeSpanRecordingPolicy
from kvsplice.client.modes.shared import is_reused, plan_position_only, replace_spans, reuse_spans

logger = logging.getLogger(__name__)


def halo_split(span: PlanSpan, num_halo: int) -> tuple[PlanSpan, ...]:
    """`span` as (its first h tokens computed from embeddings, the rest as before).

    h ≥ the span's length computes all of it; h = 0 returns the span unchanged.
    """
    if num_halo < 0:
        raise ValueError(f"num_halo {num_halo} < 0")
    if num_halo == 0:
        return (span,)
    cut = min(span.start + num_halo, span.end)
    halo = computed_span(span.start, cut, f"{span.name}:halo")
    if cut == span.end:
        return (halo,)
    return halo, slice_span(span, cut, span.end)


def halo_plan(plan: CallPlan, num_halo: int, exact_names: Container[str] = frozenset()) -> CallPlan:
    """`plan` with the first h tokens of every approximately reused span recomputed.

    Approximate: the span reads provided K/V for some layer, does not start at
    slot 0 (nothing precedes it in the plan, so its first token's sink is the
    real one) and is not named in `exact_names` (its left context matched).
    """
    spans: list[PlanSpan] = []
    for span in plan.spans:
        repair = is_reused(span) and span.start > 0 and span.name not in exact_names
        spans.extend(halo_split(span, num_halo) if repair else (span,))
    return replace_spans(plan, spans)


@dataclass(frozen=True, eq=False)
class AcceptanceResult:
    """kl_nats[i] belongs to probe_slots[i]; reuse: the run of the probed plan.

    reference_token_layers: tokens × layers the reference run computed (its cost).
    """

    accepted: bool
    probe_slots: tuple[int, ...]
    kl_nats: tuple[float, ...]
    reuse: LayerwiseResult
    reference_token_layers: int


def check_acceptance(
    executor: LayerwiseExecutor,
    plan: CallPlan,
    num_probe: int = 4,
    epsilon_nats: float = 0.05,
    exact_names: Container[str] = frozenset(),
) -> AcceptanceResult:
    """Run `plan` with `num_probe` probes per approximate span and the reference; accept
    when boundary KL stays under ε = `epsilon_nats` for a strict majority of probes."""
    probed, probes = probed_plan(plan, num_probe, exact_names)
    reuse = executor.run(probed)
    if not probes:
        return AcceptanceResult(True, (), (), reuse, 0)
    reference = executor.run(reference_plan(probed, probes, exact_names))
    rows = [probed.logits_slots.index(slot) for slot in probes]
    kl = kl_nats(reference.logits, reuse.logits[rows])
    within = sum(k <= epsilon_nats for k in kl)
    accepted = within * 2 > len(kl)
    logger.debug("acceptance %s: probes %s KL %s", accepted, probes, kl)
    return AcceptanceResult(accepted, probes, kl, reuse, sum(reference.num_computed))


def probed_plan(
    plan: CallPlan, num_probe: int, exact_names: Container[str] = frozenset()
) -> tuple[CallPlan, tuple[int, ...]]:
    """`plan` with the last m tokens of each approximate span computed and their logits asked."""
    spans: list[PlanSpan] = []
    probes: list[int] = []
    for span in plan.spans:
        if not _approximate(span, exact_names):
            spans.append(span)
            continue
        cut = max(span.start, span.end - num_probe)
        if cut > span.start:
            spans.append(slice_span(span, span.start, cut))
        spans.append(computed_span(cut, span.end, f"{span.name}:probe"))
        probes.extend(range(cut, span.end))
    slots = (*plan.logits_slots, *probes)
    return replace_spans(plan, spans, logits_slots=slots), tuple(probes)


def reference_plan(
    plan: CallPlan, probes: Sequence[int], exact_names: Container[str] = frozenset()
) -> CallPlan:
    """Tokens [0, last probe] with every approximate span computed; logits at `probes`."""
    end = max(probes) + 1
    spans = []
    for span in plan.spans:
        if span.start >= end:
            break
        cut = slice_span(span, span.start, min(span.end, end))
        spans.append(
            computed_span(cut.start, cut.end, cut.name) if _approximate(span, exact_names) else cut
        )
    ids = plan.token_ids[:end]
    return CallPlan(ids, tuple(spans), plan.position_offset, logits_slots=tuple(probes))


def kl_nats(reference_logits: torch.Tensor, reuse_logits: torch.Tensor) -> tuple[float, ...]:
    """Per row, KL(softmax(reference) ‖ softmax(reuse)) in nats; logits [N, V]."""
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    new = torch.log_softmax(reuse_logits.double(), dim=-1)
    return tuple(float(k) for k in (ref.exp() * (ref - new)).sum(dim=-1))


def _approximate(span: PlanSpan, exact_names: Container[str]) -> bool:
    return is_reused(span) and span.start > 0 and span.name not in exact_names


MODE = "halo"


@dataclass(frozen=True)
class Params:
    """halo's parameters (`halo:h=4+eps=0.05`): num_halo h, tokens recomputed at the start
    of each approximate span (EPIC: k ≤ 32); epsilon_nats, the boundary KL test's bound
    (None: reuse without testing) with `num_probe` trailing tokens probed per span."""

    num_halo: int = knob(
        4, "h", "tokens recomputed at the start of each approximate span", low=0, grid=(8, 4, 2)
    )
    epsilon_nats: float | None = knob(
        None, "eps", "the boundary KL acceptance bound in nats, or none (no test)", low=0
    )
    num_probe: int = knob(4, "probes", "trailing tokens the KL test probes per span", variant=False)

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.num_probe < 1:
            raise ValueError(f"num_probe {self.num_probe} must be >= 1")


class HaloPolicy(WholeSpanRecordingPolicy):
    mode = MODE

    def __init__(self, params: Params | None = None) -> None:
        self.params = params or Params()

    def plan(self, prompt: SpannedPrompt, ctx: CallContext) -> PlannedCall[None]:
        naive = plan_position_only(prompt, ctx, MODE)
        if all(s.source is None or s.source.exact for s in naive.plan.spans):
            return naive  # exact reuse or nothing: no junction to repair
        executor = ctx.executor.layerwise
        spans = reuse_spans(naive.plan, approx_start_layer=executor.num_layers, mode=MODE)
        exact_names = {s.name for s in spans if s.source is not None and s.source.exact}
        reused = CallPlan(naive.plan.token_ids, tuple(spans))
        plan = halo_plan(reused, self.params.num_halo, exact_names)
        epsilon, num_probe = self.params.epsilon_nats, self.params.num_probe
        if epsilon is None:
            return PlannedCall(plan, records=naive.records)
        with timed(ctx.timings, "prefill_s"):
            verdict = check_acceptance(executor, plan, num_probe, epsilon, exact_names)
        decisions = {"halo_acceptance": "accepted" if verdict.accepted else "rejected"}
        if not verdict.accepted:
            logger.debug("halo rejected: boundary KL %s > %s", verdict.kl_nats, epsilon)
            return PlannedCall(exact_only(naive.plan), records=naive.records, decisions=decisions)
        probed, _ = probed_plan(plan, num_probe, exact_names)
        return PlannedCall(probed, verdict.reuse, records=naive.records, decisions=decisions)


def exact_only(plan: CallPlan) -> CallPlan:
    """`plan` with every approximate reuse computed instead (the dense fallback)."""
    spans = tuple(
        computed_span(s.start, s.end, s.name) if s.source is not None and not s.source.exact else s
        for s in plan.spans
    )
    return replace_spans(plan, spans)


SPEC = ModeSpec(MODE, Params, HaloPolicy)
