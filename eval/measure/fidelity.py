"""Fidelity of a reuse call against dense prefill of the identical prompt on the same model.

Owns `DenseReferences` (one dense prefill, and greedy output, per distinct
prompt; never timed into a call's TTFT) and `compare` (first-token agreement,
KL(dense ‖ reuse) of the first-token distribution, max |Δlogit|, output match).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvsplice.client.execute.execution import CallTimings, GenerationConfig
from kvsplice.client.execute.plan import CallPlan
from kvsplice.client.modes.base import SpannedPrompt
from kvsplice.client.reuse_engine import ReuseEngine

logger = logging.getLogger(__name__)

REFERENCE_KINDS = ("full", "first_token", "off")


@dataclass(frozen=True)
class Reference:
    """Dense prefill of a prompt: first-token logits [V] fp32, greedy output (None if not run)."""

    logits_first: torch.Tensor
    output_ids: tuple[int, ...] | None
    ttft_s: float


@dataclass(frozen=True)
class Fidelity:
    first_token_agrees: bool
    kl_dense_reuse: float
    max_abs_logit_diff: float
    output_matches: bool | None


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p ‖ q) in nats of the softmax distributions of two [V] logit vectors (float64).

    Clamped at 0: the exact value is >= 0 and summation noise must not flip its sign.
    """
    log_p = torch.log_softmax(p_logits.double(), dim=-1)
    log_q = torch.log_softmax(q_logits.double(), dim=-1)
    return max(0.0, float((log_p.exp() * (log_p - log_q)).sum()))


def compare(
    reference: Reference, logits_first: torch.Tensor, output_ids: Sequence[int]
) -> Fidelity:
    """How a call's first-token logits [V] and greedy output differ from `reference`'s."""
    ref_logits = reference.logits_first.float()
    logits = logits_first.float()
    matches = None if reference.output_ids is None else tuple(output_ids) == reference.output_ids
    return Fidelity(
        first_token_agrees=int(torch.argmax(ref_logits)) == int(torch.argmax(logits)),
        kl_dense_reuse=kl_divergence(ref_logits, logits),
        max_abs_logit_diff=float((ref_logits - logits).abs().max()),
        output_matches=matches,
    )


class DenseReferences:
    """Dense references computed on demand, once per (prompt ids, generation limits).

    `kind` "full" also generates the dense greedy output; "first_token" only
    prefills. A dense-mode call can be `remember`ed as the reference of its own
    prompt: it ran exactly the all-compute plan `dense_reference` runs.
    """

    def __init__(self, engine: ReuseEngine, kind: str = "full") -> None:
        if kind not in REFERENCE_KINDS[:2]:
            raise ValueError(f"reference kind {kind!r} not in {REFERENCE_KINDS[:2]}")
        self._engine = engine
        self._kind = kind
        self._cache: dict[tuple[tuple[int, ...], GenerationConfig], Reference] = {}

    def remember(
        self,
        token_ids: Sequence[int],
        generation: GenerationConfig,
        logits_first: torch.Tensor,
        output_ids: Sequence[int],
        ttft_s: float,
    ) -> Reference:
        output = tuple(output_ids) if self._kind == "full" else None
        reference = Reference(logits_first, output, ttft_s)
        self._cache[(tuple(token_ids), generation)] = reference
        return reference

    def get(self, prompt: SpannedPrompt, generation: GenerationConfig) -> Reference:
        """The reference of `prompt`, computed (outside any call's clock) on a miss."""
        key = (tuple(prompt.token_ids), generation)
        if key not in self._cache:
            self._cache[key] = self._compute(prompt, generation)
        return self._cache[key]

    def _compute(self, prompt: SpannedPrompt, generation: GenerationConfig) -> Reference:
        if self._kind == "full":
            outcome = self._engine.dense_reference(prompt, generation)
            return Reference(outcome.logits_first, outcome.output_ids, outcome.ttft_s)
        start_s = time.perf_counter()
        plan = CallPlan.all_compute(prompt.token_ids)
        state = self._engine.executor.prefill(plan, CallTimings())
        return Reference(state.logits_first, None, time.perf_counter() - start_s)
