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

from kvsplice.common.reuse_modes import (
    check_fingerprint,
    engine_modes_admitted,
    read_policy_document,
    shipped_policy_path,
)

logger = logging.getLogger(__name__)


def admitted_engine_modes(policy_path: str | None, fingerprint: str) -> tuple[str, ...]:
    """The approximate modes (in the policy's order: "gated" picks the first) the policy at `policy_path` admits for the model
    `fingerprint` (None: the one shipped for it; none shipped: the safe default, none).

    Raises FingerprintMismatch (a policy calibrated on another model), FileNotFoundError
    (a named policy that is missing) and ValueError (not a policy) at the engine's start.
    """
    path = Path(policy_path) if policy_path is not None else shipped_policy_path(fingerprint)
    if path is None:
        logger.info(
            "kvsplice: requests asking for reuse 'gated' get exact reuse only: no admission "
            "policy ships for model %s, and none admits an approximate mode until the graded "
            "yardstick has (docs/vllm.md, 'Approximate reuse'); reuse_policy names one",
            fingerprint,
        )
        return ()
    source = str(path)
    document = read_policy_document(path.read_text(), source)
    check_fingerprint(document, fingerprint, f"admission policy {source}")
    modes = engine_modes_admitted(tuple(document["admitted_modes"]))
    logger.info(
        "kvsplice: requests asking for reuse 'gated' get %s (admission policy %s admits %s)",
        f"approximate runs ({', '.join(modes)})" if modes else "exact reuse only", path,
        ", ".join(document["admitted_modes"]),
    )  # fmt: skip
    return modes


def admits_spans(policy_path: str | None, fingerprint: str) -> bool:
    """Whether the policy admits any approximate mode the connector runs (see above)."""
    return bool(admitted_engine_modes(policy_path, fingerprint))
