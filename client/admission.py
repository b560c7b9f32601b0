"""The admission policy: which reuse modes a model may run, with which parameters (`policy.json`).

Owns `AdmissionPolicy` (frozen, one per model fingerprint), its JSON form and
`load_policy`/`save_policy`. Without a policy only `dense` and `exact` (zero
drift) are admitted. Measuring drift and choosing parameters is `calibrate`'s
job; turning parameters into policies is `client.policies.make_policy`'s.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvsplice.client.modes.multicut import ExactWindow, Window
from kvsplice.common.errors import FingerprintMismatch, KvspliceError
from kvsplice.common.fingerprint import is_fingerprint

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
SAFE_MODES = ("dense", "exact")
# Conservative until calibrated: a cut at layer l needs a longer exact left
# window the deeper it is (seed 003's example guard: W(0)=128 … W(16)=full);
# past the last point, only an identical left context admits reuse.
DEFAULT_W_EXACT: tuple[tuple[int, Window], ...] = ((4, 8), (8, 32), (12, 128))


class ModeNotAdmitted(KvspliceError):
    """A reuse mode the model's admission policy does not admit was asked for."""

    status_name = "FAILED_PRECONDITION"


@dataclass(frozen=True)
class ModeDrift:
    """What calibration measured for one mode against dense prefill of the same prompts."""

    kl_mean_nats: float
    kl_p95_nats: float
    first_token_agreement: float
    num_calls: int

    def __post_init__(self) -> None:
        for name in ("kl_mean_nats", "kl_p95_nats"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} {value!r} must be finite and >= 0")
        if not 0 <= self.first_token_agreement <= 1:
            raise ValueError(f"first_token_agreement {self.first_token_agreement} not in [0, 1]")
        if self.num_calls < 0:
            raise ValueError(f"num_calls {self.num_calls} < 0")


@dataclass(frozen=True)
class AdmissionPolicy:
    """Admitted modes and their parameters for the model `model_fingerprint`.

    w_exact: multicut's guard points ((layer, tokens | "full"), ...); blend_ratio:
    CacheBlend's r; halo_tokens: h; halo_epsilon_nats: the acceptance KL bound
    (None: no acceptance test); anchor_gamma/anchor_tau: KVComm's gate γ and
    weight temperature; anchor_metric: the gate's distance ("value" or "key";
    the anchor policy stores no boundary states for "hidden"); anchor_repair_ratio:
    CacheBlend's r on the corrected K/V (None: no repair, corrections read at every layer);
    anchor_min_coverage: the share of a placeholder anchors must cover (1: KVComm's
    length rule; below: the covered first tokens are corrected, the rest computed). created_at: ISO 8601 time of calibration (None: built in).
    """

    model_fingerprint: str
    admitted_modes: tuple[str, ...] = SAFE_MODES
    w_exact: tuple[tuple[int, Window], ...] = DEFAULT_W_EXACT
    blend_ratio: float = 0.15
    halo_tokens: int = 4
    halo_epsilon_nats: float | None = None
    anchor_gamma: float = 0.3
    anchor_tau: float = 0.1
    anchor_metric: str = "value"
    anchor_repair_ratio: float | None = None
    anchor_min_coverage: float = 1.0
    created_at: str | None = None
    drift: Mapping[str, ModeDrift] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not is_fingerprint(self.model_fingerprint):
            raise ValueError(f"model_fingerprint {self.model_fingerprint!r} is malformed")
        modes = tuple(self.admitted_modes)
        if "dense" not in modes or len(set(modes)) != len(modes):
            raise ValueError(f"admitted_modes {modes} must be distinct and include 'dense'")
        object.__setattr__(self, "admitted_modes", modes)
        object.__setattr__(self, "w_exact", ExactWindow(tuple(self.w_exact)).points)
        if not 0 <= self.blend_ratio <= 1:
            raise ValueError(f"blend_ratio {self.blend_ratio} must be in [0, 1]")
        if self.halo_tokens < 0:
            raise ValueError(f"halo_tokens {self.halo_tokens} must be >= 0")
        if self.halo_epsilon_nats is not None and not self.halo_epsilon_nats >= 0:
            raise ValueError(f"halo_epsilon_nats {self.halo_epsilon_nats} must be >= 0")
        if not 0 <= self.anchor_gamma <= 1:
            raise ValueError(f"anchor_gamma {self.anchor_gamma} must be in [0, 1]")
        if self.anchor_metric not in ("value", "key"):
            raise ValueError(f"anchor_metric {self.anchor_metric!r} is not 'value' or 'key'")
        if self.anchor_repair_ratio is not None and not 0 <= self.anchor_repair_ratio <= 1:
            raise ValueError(f"anchor_repair_ratio {self.anchor_repair_ratio} must be in [0, 1]")
        if not 0 < self.anchor_min_coverage <= 1:
            raise ValueError(f"anchor_min_coverage {self.anchor_min_coverage} must be in (0, 1]")
        if not self.anchor_tau > 0:
            raise ValueError(f"anchor_tau {self.anchor_tau} must be > 0")

    def admits(self, mode: str) -> bool:
        return mode in self.admitted_modes

    def check(self, fingerprint: str, mode: str) -> None:
        """Raise unless this policy is `fingerprint`'s and admits `mode`."""
        if fingerprint != self.model_fingerprint:
            raise FingerprintMismatch(
                f"admission policy is for model {self.model_fingerprint}, not {fingerprint}"
            )
        if not self.admits(mode):
            raise ModeNotAdmitted(
                f"mode {mode!r} is not admitted for {fingerprint} "
                f"(admitted: {', '.join(self.admitted_modes)}); calibrate it first"
            )

    def to_json(self) -> str:
        document: dict[str, Any] = {"format_version": FORMAT_VERSION, **asdict(self)}
        document["admitted_modes"] = list(self.admitted_modes)
        document["w_exact"] = [list(point) for point in self.w_exact]
        return json.dumps(document, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> AdmissionPolicy:
        """Parse `to_json`'s output; ValueError naming what is wrong."""
        document = json.loads(text)
        if not isinstance(document, dict) or document.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"admission policy is not format version {FORMAT_VERSION}")
        document.pop("format_version")
        try:
            drift = {m: ModeDrift(**d) for m, d in document.pop("drift", {}).items()}
            points = tuple((int(layer), _window(w)) for layer, w in document.pop("w_exact"))
            modes = tuple(str(m) for m in document.pop("admitted_modes"))
            return cls(**document, admitted_modes=modes, w_exact=points, drift=drift)
        except (KeyError, TypeError) as error:
            raise ValueError(f"malformed admission policy: {error!r}") from error


def default_policy(fingerprint: str) -> AdmissionPolicy:
    """The safe default: only `dense` and `exact`, which never drift from dense prefill."""
    return AdmissionPolicy(model_fingerprint=fingerprint)


def load_policy(path: Path | str | None, fingerprint: str) -> AdmissionPolicy:
    """The policy at `path` for the model `fingerprint`; the safe default when `path` is None.

    Raises FingerprintMismatch for a policy calibrated on another model, and
    FileNotFoundError for a path that does not exist (a named policy that is
    missing is a deployment error, not a reason to run with defaults).
    """
    if path is None:
        return default_policy(fingerprint)
    policy = AdmissionPolicy.from_json(Path(path).read_text())
    if policy.model_fingerprint != fingerprint:
        raise FingerprintMismatch(
            f"admission policy {path} is for model {policy.model_fingerprint}, not {fingerprint}"
        )
    logger.info("admission policy %s admits %s", path, ", ".join(policy.admitted_modes))
    return policy


def save_policy(policy: AdmissionPolicy, path: Path | str) -> None:
    """Write `policy` as JSON, atomically (a reader never sees half a file)."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(policy.to_json())
    os.replace(partial, target)


def _window(raw: object) -> Window:
    if raw == "full":
        return "full"
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    raise ValueError(f"W_exact window {raw!r} must be a token count or 'full'")
