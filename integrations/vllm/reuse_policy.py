"""Which approximate modes an engine may give requests that opt in: its admission policy.

The connector runs two approximate modes (`common.reuse_modes.ENGINE_MODES`): `naive` (a
shared span's stored K/V, keys moved by the exact RoPE Δ) and `anchor` (the same K/V
corrected at load by offsets estimated from stored anchors, KVComm's gate falling back to
exact). A request gets one only when a policy for the model admits it; otherwise it gets
exact reuse, as every other request does. No policy the package ships admits one: the graded
answers naive was once admitted on could not have refused it (issue 50), so until the graded
yardstick (`bench vllm-graded --admit`, its rule in `eval/bench/vllm/yardstick_rule.json`)
admits a mode, engines run exact reuse unless a deployment names a policy (`reuse_policy`).
The policy's format and where policies ship are `common.reuse_modes`'s, as the HF worker's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvsplice.common.reuse_modes import (
    check_fingerprint,
    engine_modes_admitted,
    read_policy_document,
    shipped_policy_path,
)

logger = logging.getLogger(__name__)


def _policy(policy_path: str | None, fingerprint: str) -> tuple[dict[str, Any], str] | None:
    """The policy at `policy_path` (None: the one shipped for model `fingerprint`), checked
    against the model, and what to call it; None when none applies."""
    path = Path(policy_path) if policy_path is not None else shipped_policy_path(fingerprint)
    if path is None:
        return None
    source = f"admission policy {path}"
    document = read_policy_document(path.read_text(), source)
    check_fingerprint(document, fingerprint, source)
    return document, source


def admitted_engine_modes(policy_path: str | None, fingerprint: str) -> tuple[str, ...]:
    """The approximate modes (in the policy's order: "gated" picks the first) the policy at
    `policy_path` admits for the model `fingerprint` (None: the one shipped for it; none
    shipped: the safe default, none).

    Raises FingerprintMismatch (a policy calibrated on another model), FileNotFoundError
    (a named policy that is missing) and ValueError (not a policy) at the engine's start.
    """
    found = _policy(policy_path, fingerprint)
    if found is None:
        logger.info(
            "kvsplice: requests asking for reuse 'gated' get exact reuse only: no admission "
            "policy ships for model %s, and none admits an approximate mode until the graded "
            "yardstick has (docs/vllm.md, 'Approximate reuse'); reuse_policy names one",
            fingerprint,
        )
        return ()
    document, source = found
    modes = engine_modes_admitted(tuple(document["admitted_modes"]))
    logger.info(
        "kvsplice: requests asking for reuse 'gated' get %s (%s admits %s)",
        f"approximate runs ({', '.join(modes)})" if modes else "exact reuse only", source,
        ", ".join(document["admitted_modes"]),
    )  # fmt: skip
    return modes


def mode_params(policy_path: str | None, fingerprint: str, mode: str) -> tuple[dict[str, Any], str]:
    """The parameters the policy calibrated `mode` with (`params[mode]`; {} when no policy
    applies, it does not admit `mode`, or gives none: the mode's defaults), and what to
    call them in an error. Raises as `admitted_engine_modes` does."""
    found = _policy(policy_path, fingerprint)
    if found is None:
        return {}, "no admission policy"
    document, source = found
    if mode not in document["admitted_modes"]:
        return {}, source
    params = document.get("params", {}).get(mode, {})
    if not isinstance(params, dict):
        raise ValueError(f"{source}: params[{mode!r}] must be an object")
    return dict(params), source


def admits_spans(policy_path: str | None, fingerprint: str) -> bool:
    """Whether the policy admits any approximate mode the connector runs (see above)."""
    return bool(admitted_engine_modes(policy_path, fingerprint))
