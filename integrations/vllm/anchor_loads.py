"""The anchor mode at load: a load's runs, placed as naive places them, corrected by stored anchors.

KVComm (seed 002) inside the connector. `SpanWriter` decodes each run and moves its keys
(naive's K/V, the run's base); then `AnchorCorrector.correct` fetches the pool of the
runs' context (`context_pool_id`), gates each run on it (`kvmath.anchor_gate`: a run seen
before in this context takes its own anchor, any other KVComm's length rule and entropy
test) and, when every run passes, replaces the placed K/V by base + Σ w·offset
(`kvmath.anchor_correction.correct`). A refusal raises
`GateRefused`: the request's runs are recomputed (exact reuse) and then become anchors
(`anchors_due`, `anchor_saves`). Owns the pool's reading; the math is kvmath's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvsplice.common.keys import content_key
from kvsplice.integrations.vllm.segment_fetch import LoadFault
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.integrations.vllm.transfer_specs import LoadSpec
from kvsplice.kvmath.anchor_correction import AnchorQuery, correct
from kvsplice.kvmath.anchor_gate import GateDecision, decide, exact_match
from kvsplice.kvmath.anchor_payload import decode_anchor_payloads
from kvsplice.kvmath.anchors import Anchor
from kvsplice.kvmath.rope import RopeSpec
from kvsplice.kvmath.segment_kv import SegmentKV

logger = logging.getLogger(__name__)

# The most recent anchors of a pool read per load (each one fetch and decode).
MAX_POOL_ANCHORS = 8


@dataclass(frozen=True)
class AnchorGate:
    """KVComm's gate as the HF loop's `anchor` mode runs it by default (`anchor.params`):
    γ (H > γ·log2|A| refuses), the weights' temperature τ, the base distance."""

    gamma: float = 0.3
    tau: float = 0.1
    metric: str = "value"

    def __post_init__(self) -> None:
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma {self.gamma} must be in [0, 1]")
        if not self.tau > 0:
            raise ValueError(f"tau {self.tau} must be > 0")
        if self.metric not in ("value", "key"):
            raise ValueError(f"metric {self.metric!r} must be 'value' or 'key'")

    @classmethod
    def from_policy(cls, params: Mapping[str, Any], source: str) -> AnchorGate:
        """The gate an admission policy calibrated (`params["anchor"]`, the HF loop's
        `anchor.params` names): its γ, τ and metric. A policy calibrated with a part of the
        HF mode the connector does not run (CacheBlend's repair, partial coverage, pooled
        judges) is refused, naming it: its evidence is not for what the engine would run."""
        off = {k: params[k] for k, unused in NOT_RUN.items() if k in params and params[k] != unused}
        if off:
            raise ValueError(
                f"{source}: the anchor mode was calibrated with {off}, which the vLLM "
                f"connector does not run (it runs KVComm's gate and correction: gamma, tau, "
                f"metric); calibrate without them for engines"
            )
        return cls(**{k: params[k] for k in ("gamma", "tau", "metric") if k in params})


# The HF anchor mode's parameters the connector does not run, at their "not used" values
# (the rest are the HF loop's storage details: the connector's payloads are its own).
NOT_RUN: dict[str, Any] = {"repair_ratio": None, "min_coverage": 1.0, "pool_judges": 0}


class GateRefused(LoadFault):
    """The anchor gate refused a load's runs (`refusal`: why): they are recomputed."""

    def __init__(self, position: int, refusal: str) -> None:
        super().__init__(position, f"the anchor gate refused: {refusal}")
        self.refusal = refusal


def context_pool_id(token_ids: Sequence[int], first_run_start: int) -> str:
    """The pool of a load's runs, and the owner of its anchors' offsets: the request's
    tokens before its first run, by content (requests under one stored persona share it;
    KVComm's per-agent offsets, the agent being the context a shared text lands in)."""
    return "ctx-" + content_key(tuple(int(t) for t in token_ids[:first_run_start])).hex()[:40]


class AnchorCorrector:
    def __init__(
        self, clients: StoreClients, rope: Callable[[], RopeSpec], gate: AnchorGate | None = None
    ) -> None:
        self.clients = clients
        self._rope = rope
        self.gate = gate or AnchorGate()
        self.num_corrected_runs = 0
        self.num_refusals = 0

    def correct(
        self, spec: LoadSpec, position: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Correct the runs in place: keys, values [L, H_kv, T, D], tokens `[position,
        spec.end)` as naive placed them. Raises GateRefused (nothing changed) unless the
        gate is confident for every run."""
        rope, gate = self._rope(), self.gate
        pool_id = context_pool_id(spec.token_ids, spec.spans[0].start)
        pool = self._pool(spec, pool_id, keys.device)
        corrected: list[tuple[int, int, SegmentKV]] = []
        for span in spec.spans:
            lo, hi = span.start - position, min(span.end, spec.end) - position
            base = SegmentKV(keys[:, :, lo:hi].float(), values[:, :, lo:hi].float(), span.start)
            own = exact_match(base, pool, rope, pool_id)
            if own is not None:  # this run seen before in this context: its own offset
                chosen = [own]
            else:
                decision = decide(
                    base, pool, rope, pool_id, gamma=gate.gamma, metric=gate.metric, tau=gate.tau
                )  # fmt: skip
                if not decision.reuse:
                    self.num_refusals += 1
                    raise GateRefused(position, _why(decision, len(pool)))
                chosen = [a for a in pool if a.anchor_id in decision.anchor_ids]
            query = AnchorQuery(pool_id, base, span.start)
            corrected.append((lo, hi, correct(query, chosen, rope, gate.tau).placeholder))
        for lo, hi, kv in corrected:
            keys[:, :, lo:hi].copy_(kv.keys)
            values[:, :, lo:hi].copy_(kv.values)
        self.num_corrected_runs += len(corrected)

    def _pool(self, spec: LoadSpec, pool_id: str, device: torch.device) -> list[Anchor]:
        """The pool's most recent anchors holding this context's offsets, decoded (fp32)."""
        store = self.clients.for_namespace(spec.namespace)
        listed = store.get_anchors(spec.root, pool_id, include_payloads=False)
        own = sorted((e for e in listed if pool_id in e.agent_ids), key=lambda e: -e.created_seq)
        pool = []
        for listed_entry in own[:MAX_POOL_ANCHORS]:
            for entry in store.get_anchors(
                spec.root, pool_id, anchor_ids=(listed_entry.anchor_id,), agent_id=pool_id
            ):
                anchor = decode_anchor_payloads(
                    entry.anchor_id, entry.num_tokens, entry.base_payload,
                    entry.agent_payloads.get(pool_id), pool_id,
                    fingerprint=spec.root, dtype=torch.float32, device=device,
                )  # fmt: skip
                if anchor is not None and anchor.offsets(pool_id) is not None:
                    pool.append(anchor)
        return pool


def _why(decision: GateDecision, num_pooled: int) -> str:
    """The gate's reason in words (the request's report says it)."""
    if decision.reason == "pool_too_small":
        return f"{num_pooled} stored anchor(s) for this context; KVComm's gate wants 2"
    if decision.reason == "too_few_eligible":
        return "fewer than 2 stored anchors for this context as long as the run"
    return (
        f"ambiguous: the anchors' weights have {decision.entropy_bits:.2f} bits "
        f"> {decision.threshold_bits:.2f}"
    )
