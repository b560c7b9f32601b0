"""Halo recompute (EPIC's LegoLink, seed 004): recompute the first h tokens of each reused span.

A span's K/V captured in another context carry that context's attention sink
and boundary; recomputing its first h tokens against the true left context
repairs the junction while the rest stays reused. Owns the plan transform
only; the KL acceptance test lives in `halo_acceptance`.
"""

from __future__ import annotations

import logging
from collections.abc import Container

from kvsplice.client.layerwise import LayerwisePlan, LayerwiseSpan
from kvsplice.client.modes.spans import computed_span, is_reused, replace_spans, slice_span

logger = logging.getLogger(__name__)


def halo_split(span: LayerwiseSpan, num_halo: int) -> tuple[LayerwiseSpan, ...]:
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


def halo_plan(
    plan: LayerwisePlan, num_halo: int, exact_names: Container[str] = frozenset()
) -> LayerwisePlan:
    """`plan` with the first h tokens of every approximately reused span recomputed.

    Approximate: the span reads provided K/V for some layer, does not start at
    slot 0 (nothing precedes it in the plan, so its first token's sink is the
    real one) and is not named in `exact_names` (its left context matched).
    """
    spans: list[LayerwiseSpan] = []
    for span in plan.spans:
        repair = is_reused(span) and span.start > 0 and span.name not in exact_names
        spans.extend(halo_split(span, num_halo) if repair else (span,))
    return replace_spans(plan, spans)
