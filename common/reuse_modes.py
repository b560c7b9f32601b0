"""The one vocabulary of reuse modes both engines speak, and the admission policy's file format.

Owns the names a request, a policy file and a bench config use for a mode (`DENSE` ...
`GATED`), which approximate modes a KV connector can carry (`ENGINE_MODES`), the policy
document's envelope (`read_policy_document`: version, fingerprint, admitted modes) and
where policies ship (`shipped_policy_path`). Read by the HF worker
(`client.modes.admission`) and the vLLM connector (`integrations.vllm.reuse_policy`)
alike. What each mode does, and its parameters, is the engines'. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvsplice.common.errors import FingerprintMismatch

DENSE = "dense"  # everything computed
EXACT = "exact"  # exact stored prefixes only: zero drift
NAIVE = "naive"  # a shared span's stored K/V, keys moved by the RoPE Δ, nothing corrected
ANCHOR = "anchor"  # KVComm (seed 002): naive's K/V corrected by offsets from stored anchors
GATED = "gated"  # a request's "the best approximate mode the policy admits, else exact"

# The approximate modes a KV connector can run at load. `GATED` picks the first of them a
# policy admits, in the policy's order (as the HF worker's `AdmissionPolicy.serving_mode`).
ENGINE_MODES = (ANCHOR, NAIVE)

POLICY_FORMAT_VERSION = 2
# Policies shipped with the package, one `<model fingerprint>.json` each.
SHIPPED_DIR = Path(__file__).resolve().parent / "shipped_policies"

# version 1's flat fields -> (mode, field of its Params)
V1_FIELDS: dict[str, tuple[str, str]] = {
    "w_exact": ("multicut", "w_exact"),
    "blend_ratio": ("blend", "ratio"),
    "halo_tokens": ("halo", "num_halo"),
    "halo_epsilon_nats": ("halo", "epsilon_nats"),
    "anchor_gamma": (ANCHOR, "gamma"),
    "anchor_tau": (ANCHOR, "tau"),
    "anchor_metric": (ANCHOR, "metric"),
    "anchor_repair_ratio": (ANCHOR, "repair_ratio"),
    "anchor_min_coverage": (ANCHOR, "min_coverage"),
}
V1_KEPT = {"format_version", "model_fingerprint", "admitted_modes", "created_at", "drift"}


def shipped_policy_path(fingerprint: str) -> Path | None:
    """The policy the package ships for the model `fingerprint` (None: none ships)."""
    path = SHIPPED_DIR / f"{fingerprint}.json"
    return path if path.is_file() else None


def read_policy_document(text: str, source: str = "admission policy") -> dict[str, Any]:
    """A policy file's JSON as a version-2 document (a version-1 one upgraded), its
    envelope checked; ValueError naming what is wrong (`source`: what to call the file)."""
    document = json.loads(text)
    if not isinstance(document, dict) or "format_version" not in document:
        raise ValueError(f"{source} is not an admission policy (kvsplice calibrate writes one)")
    if document.get("format_version") == 1:
        document = upgrade_v1(document)
    if document.get("format_version") != POLICY_FORMAT_VERSION:
        raise ValueError(f"{source} is not format version {POLICY_FORMAT_VERSION} (or 1)")
    modes = document.get("admitted_modes")
    if not isinstance(modes, list) or not all(isinstance(m, str) for m in modes):
        raise ValueError(f"{source}: admitted_modes must be a list of mode names")
    return document


def check_fingerprint(document: Mapping[str, Any], fingerprint: str, source: str) -> None:
    """Raise FingerprintMismatch unless `document` is the policy of model `fingerprint`."""
    found = document.get("model_fingerprint")
    if found != fingerprint:
        raise FingerprintMismatch(f"{source} is for model {found}, not {fingerprint}")


def upgrade_v1(document: Mapping[str, Any]) -> dict[str, Any]:
    """A version-1 document (flat `anchor_gamma`, `blend_ratio`, ... fields) as version 2.

    Migration: `kvsplice.client.modes.admission.save_policy(load_policy(path, fp), path)`.
    """
    params: dict[str, dict[str, Any]] = {}
    for name, (mode, field_name) in V1_FIELDS.items():
        if name in document:
            params.setdefault(mode, {})[field_name] = document[name]
    unknown = set(document) - set(V1_FIELDS) - V1_KEPT
    if unknown:
        raise ValueError(f"unknown fields in a version-1 admission policy: {sorted(unknown)}")
    kept = {name: document[name] for name in V1_KEPT if name in document}
    return {"created_at": None, "drift": {}, **kept, "format_version": 2, "params": params}


def engine_modes_admitted(admitted_modes: tuple[str, ...]) -> tuple[str, ...]:
    """The approximate modes a connector can run among `admitted_modes`, in their order."""
    return tuple(m for m in admitted_modes if m in ENGINE_MODES)
