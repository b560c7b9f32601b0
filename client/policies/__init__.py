"""Reuse policies: one module per mode; `make_policy` builds one by name (and admission)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from kvsplice.client.admission import AdmissionPolicy
from kvsplice.client.modes.anchor_gate import GateConfig
from kvsplice.client.modes.anchor_types import Metric
from kvsplice.client.modes.anchor_weights import WeightConfig
from kvsplice.client.modes.blend import BlendConfig
from kvsplice.client.modes.halo_acceptance import AcceptanceConfig
from kvsplice.client.modes.multicut import ExactWindow
from kvsplice.client.policies.anchor import AnchorConfig, AnchorPolicy
from kvsplice.client.policies.base import (
    CallContext,
    PlanBuilder,
    PromptSpan,
    ReusePolicy,
    SpannedPrompt,
    span_role,
)
from kvsplice.client.policies.blend import BlendPolicy
from kvsplice.client.policies.dense import DensePolicy
from kvsplice.client.policies.exact import ExactPolicy
from kvsplice.client.policies.halo import HaloConfig, HaloPolicy
from kvsplice.client.policies.layerwise_call import LayerwiseCall
from kvsplice.client.policies.multicut import MulticutConfig, MulticutPolicy
from kvsplice.client.policies.naive import NaivePolicy

# name -> the policy with its parameters from an admission policy (None: defaults)
POLICIES: dict[str, Callable[[AdmissionPolicy | None], ReusePolicy]] = {
    "dense": lambda _: DensePolicy(),
    "exact": lambda _: ExactPolicy(),
    "naive": lambda _: NaivePolicy(),
    "anchor": lambda a: AnchorPolicy(_anchor_config(a)),
    "multicut": lambda a: MulticutPolicy(_multicut_config(a)),
    "blend": lambda a: BlendPolicy(BlendConfig(ratio=a.blend_ratio) if a else None),
    "halo": lambda a: HaloPolicy(_halo_config(a)),
}
MODES = tuple(POLICIES)
# NOTE: the modes whose plans read the store through LookupPrefix and GetSegment
# alone. The worker's local tier holds a call's segments from the moment they are
# queued, so for these modes a put still in flight is already visible to the next
# call and puts can run in the background. The other modes also ask the sidecar's
# indexes (FindSimilar, anchor pools), which know a segment only once it is put:
# their engines put before `run` returns, so a pipeline's reuse stays deterministic.
CHAIN_ONLY_MODES = ("dense", "exact")


def make_policy(mode: str, admission: AdmissionPolicy | None = None) -> ReusePolicy:
    """The policy of `mode` (one of `MODES`), with `admission`'s parameters when given.

    Whether `mode` is admitted is the engine's check (`AdmissionPolicy.check`).
    """
    if mode not in POLICIES:
        raise ValueError(f"mode {mode!r} not in {MODES}")
    return POLICIES[mode](admission)


def _anchor_config(admission: AdmissionPolicy | None) -> AnchorConfig | None:
    if admission is None:
        return None
    weights = WeightConfig(tau=admission.anchor_tau)
    gate = GateConfig(
        gamma=admission.anchor_gamma, metric=cast(Metric, admission.anchor_metric), weights=weights
    )
    ratio = admission.anchor_repair_ratio
    repair = None if ratio is None else BlendConfig(ratio=ratio)
    return AnchorConfig(gate=gate, repair=repair, min_coverage=admission.anchor_min_coverage)


def _multicut_config(admission: AdmissionPolicy | None) -> MulticutConfig | None:
    if admission is None:
        return None
    return MulticutConfig(w_exact=ExactWindow(admission.w_exact))


def _halo_config(admission: AdmissionPolicy | None) -> HaloConfig | None:
    if admission is None:
        return None
    epsilon = admission.halo_epsilon_nats
    acceptance = None if epsilon is None else AcceptanceConfig(epsilon_nats=epsilon)
    return HaloConfig(num_halo=admission.halo_tokens, acceptance=acceptance)


__all__ = [
    "MODES",
    "AnchorPolicy",
    "BlendPolicy",
    "CallContext",
    "DensePolicy",
    "ExactPolicy",
    "HaloPolicy",
    "LayerwiseCall",
    "MulticutPolicy",
    "NaivePolicy",
    "PlanBuilder",
    "PromptSpan",
    "ReusePolicy",
    "SpannedPrompt",
    "make_policy",
    "span_role",
]
