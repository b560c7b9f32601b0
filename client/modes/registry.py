"""The table of reuse modes: one line per mode. Adding a mode: its module, one line here, its tests.

Owns `REGISTRY` (name → `ModeSpec`), `make_policy` and the mode tuples derived
from it. What a mode does and which parameters it takes live in its module.
"""

from __future__ import annotations

from typing import Any

from kvsplice.client.modes import blend, crossfix, dense, exact, gated, halo, mask, multicut, naive
from kvsplice.client.modes.anchor import policy as anchor
from kvsplice.client.modes.base import ModeSpec, ReusePolicy

REGISTRY: dict[str, ModeSpec] = {
    spec.name: spec
    for spec in (
        dense.SPEC,
        exact.SPEC,
        naive.SPEC,
        anchor.SPEC,
        multicut.SPEC,
        blend.SPEC,
        halo.SPEC,
        mask.SPEC,
        crossfix.SPEC,
        gated.SPEC,
    )
}
MODES = tuple(REGISTRY)
# NOTE: the modes whose plans read the store through LookupPrefix and GetSegment
# alone. The worker's local tier holds a call's segments from the moment they are
# queued, so for these modes a put still in flight is already visible to the next
# call and puts can run in the background. The other modes also ask the sidecar's
# indexes (FindSimilar, anchor pools), which know a segment only once it is put:
# their engines put before `run` returns, so a pipeline's reuse stays deterministic.
CHAIN_ONLY_MODES = tuple(name for name, spec in REGISTRY.items() if spec.chain_only)
# The modes that never drift from dense prefill: admitted without calibration.
SAFE_MODES = tuple(name for name, spec in REGISTRY.items() if not spec.drifts and not spec.routes)
# The interaction-preserving modes calibration's judge probes may admit for judges.
JUDGE_CAPABLE_MODES = tuple(name for name, spec in REGISTRY.items() if spec.judge_capable)
# The modes `kvsplice calibrate` probes (the others are safe, or ablations).
CALIBRATED_MODES = tuple(name for name, spec in REGISTRY.items() if spec.calibrated)


def mode_spec(mode: str) -> ModeSpec:
    """The table row of `mode`; ValueError naming the known modes."""
    if mode not in REGISTRY:
        raise ValueError(f"mode {mode!r} not in {MODES}")
    return REGISTRY[mode]


def make_policy(mode: str, params: Any = None) -> ReusePolicy:
    """The policy of `mode` with `params` (its `Params`; None: the defaults).

    Whether `mode` is admitted is the engine's check (`AdmissionPolicy.check`). A mode
    that routes is built from an admission policy (`AdmissionPolicy.policy_of`).
    """
    return mode_spec(mode).policy(params)
