"""Whether an engine may give approximate runs to requests that opt in: its admission policy.

The connector expresses one approximate mode today: K/V a segment's sender computed, loaded
for the same tokens at new positions (`naive`: keys moved by the exact RoPE Δ, nothing
corrected). A request asking for `"gated"` gets such runs only when a policy for the model
admits `naive`; otherwise it gets exact reuse, as every other request does. No policy the
package ships admits one: the graded answers naive was once admitted on could not have
refused it (issue 50), so until the graded yardstick (`bench vllm-graded --admit`, its
rule in `eval/bench/vllm/yardstick_rule.json`) admits a mode, engines run exact reuse unless a
deployment names a policy of its own (`reuse_policy`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kvsplice.common.errors import FingerprintMismatch

logger = logging.getLogger(__name__)

# The reuse mode a KV connector can carry into vLLM (client.modes' name for it).
SPAN_MODE = "naive"
# NOTE: `client.modes.admission` owns the policy format and where policies ship; the vLLM
# integration may not import the client's modes (they pull transformers and the HF
# execution path into vLLM's process), so it reads the two fields it needs here.
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "client" / "modes" / "shipped"
FORMAT_VERSIONS = (1, 2)


def admits_spans(policy_path: str | None, fingerprint: str) -> bool:
    """Whether the policy at `policy_path` (None: the one shipped for `fingerprint`; none
    shipped: the safe default, which admits no approximate mode) admits `naive` for the
    model `fingerprint`.

    Raises FingerprintMismatch (a policy calibrated on another model), FileNotFoundError
    (a named policy that is missing) and ValueError (not a policy) at the engine's start.
    """
    path = Path(policy_path) if policy_path is not None else SHIPPED_DIR / f"{fingerprint}.json"
    if policy_path is None and not path.is_file():
        logger.info(
            "kvsplice: requests asking for reuse 'gated' get exact reuse only: no admission "
            "policy ships for model %s, and none admits an approximate mode until the graded "
            "yardstick has (docs/vllm.md, 'Approximate reuse'); reuse_policy names one",
            fingerprint,
        )
        return False
    modes = _admitted_modes(path, fingerprint)
    admitted = SPAN_MODE in modes
    logger.info(
        "kvsplice: requests asking for reuse 'gated' get %s (admission policy %s admits %s)",
        "approximate runs (naive)" if admitted else "exact reuse only", path, ", ".join(modes),
    )  # fmt: skip
    return admitted


def _admitted_modes(path: Path, fingerprint: str) -> tuple[str, ...]:
    document = json.loads(path.read_text())
    if not isinstance(document, dict) or document.get("format_version") not in FORMAT_VERSIONS:
        raise ValueError(f"{path} is not an admission policy (kvsplice calibrate writes one)")
    if document.get("model_fingerprint") != fingerprint:
        raise FingerprintMismatch(
            f"admission policy {path} is for model {document.get('model_fingerprint')}, "
            f"not {fingerprint}"
        )
    modes = document.get("admitted_modes")
    if not isinstance(modes, list) or not all(isinstance(m, str) for m in modes):
        raise ValueError(f"{path}: admitted_modes must be a list of mode names")
    return tuple(modes)
