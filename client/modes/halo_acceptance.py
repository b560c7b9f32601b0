"""The boundary KL acceptance test for approximate reuse (seed 004 §3.4, made precise).

Probes: the last m tokens of every approximately reused span are computed
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

from kvsplice.client.layerwise import LayerwiseExecutor, LayerwisePlan, LayerwiseResult
from kvsplice.client.layerwise import LayerwiseSpan as Span
from kvsplice.client.modes.spans import computed_span, is_reused, replace_spans, slice_span

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AcceptanceConfig:
    """num_probe m: trailing tokens probed per approximate span; epsilon_nats: KL bound."""

    num_probe: int = 4
    epsilon_nats: float = 0.05

    def __post_init__(self) -> None:
        if self.num_probe < 1:
            raise ValueError(f"num_probe {self.num_probe} must be >= 1")
        if not self.epsilon_nats >= 0:
            raise ValueError(f"epsilon_nats {self.epsilon_nats} must be >= 0")


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
    plan: LayerwisePlan,
    config: AcceptanceConfig | None = None,
    exact_names: Container[str] = frozenset(),
) -> AcceptanceResult:
    """Run `plan` with probes and the reference; accept when boundary KL stays under ε."""
    config = config or AcceptanceConfig()
    probed, probes = probed_plan(plan, config.num_probe, exact_names)
    reuse = executor.run(probed)
    if not probes:
        return AcceptanceResult(True, (), (), reuse, 0)
    reference = executor.run(reference_plan(probed, probes, exact_names))
    rows = [probed.logits_slots.index(slot) for slot in probes]
    kl = kl_nats(reference.logits, reuse.logits[rows])
    within = sum(k <= config.epsilon_nats for k in kl)
    accepted = within * 2 > len(kl)
    logger.debug("acceptance %s: probes %s KL %s", accepted, probes, kl)
    return AcceptanceResult(accepted, probes, kl, reuse, sum(reference.num_computed))


def probed_plan(
    plan: LayerwisePlan, num_probe: int, exact_names: Container[str] = frozenset()
) -> tuple[LayerwisePlan, tuple[int, ...]]:
    """`plan` with the last m tokens of each approximate span computed and their logits asked."""
    spans: list[Span] = []
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
    plan: LayerwisePlan, probes: Sequence[int], exact_names: Container[str] = frozenset()
) -> LayerwisePlan:
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
    return LayerwisePlan(ids, tuple(spans), plan.position_offset, logits_slots=tuple(probes))


def kl_nats(reference_logits: torch.Tensor, reuse_logits: torch.Tensor) -> tuple[float, ...]:
    """Per row, KL(softmax(reference) ‖ softmax(reuse)) in nats; logits [N, V]."""
    ref = torch.log_softmax(reference_logits.double(), dim=-1)
    new = torch.log_softmax(reuse_logits.double(), dim=-1)
    return tuple(float(k) for k in (ref.exp() * (ref - new)).sum(dim=-1))


def _approximate(span: Span, exact_names: Container[str]) -> bool:
    return is_reused(span) and span.start > 0 and span.name not in exact_names
