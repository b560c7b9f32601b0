"""What reuse a request asked for: its `kv_transfer_params` opt-in, read once.

The contract (the OpenAI request's `kv_transfer_params`, which vLLM hands the
connector as `request.kv_transfer_params`):

    {"kvsplice": {"reuse": "gated"}}   approximate reuse where the admission policy
                                       admits it, exact elsewhere
    {"kvsplice": {"reuse": "anchor"}}  the anchor mode (KVComm's correction at load) where
                                       the policy admits it, exact elsewhere
    {"kvsplice": {"reuse": "exact"}}   exact prefixes only (also: no "kvsplice" key)

`"gated"` picks the first approximate mode the connector runs that the policy admits, in
the policy's order (`common.reuse_modes.ENGINE_MODES`: anchor, naive).

A request without the opt-in never receives approximate K/V. A malformed value cannot
be refused from inside the scheduler (an exception there stops the engine), so it is
exact reuse, and `RequestedReuse.problem` says why (the connector logs it once per kind).
Knows vLLM's `Request` only through `kv_transfer_params`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsplice.common.reuse_modes import ANCHOR, EXACT, GATED

KEY = "kvsplice"
REUSE_VALUES = (EXACT, GATED, ANCHOR)


@dataclass(frozen=True)
class RequestedReuse:
    """`mode`: one of `REUSE_VALUES`; `problem`: what was wrong with the request's params."""

    mode: str = EXACT
    problem: str | None = None

    @property
    def approximate(self) -> bool:
        return self.mode != EXACT

    def engine_mode(self, admitted: Sequence[str]) -> str | None:
        """The approximate mode this request runs among the `admitted` ones (the policy's
        order); None: exact reuse."""
        if self.mode == GATED:
            return admitted[0] if admitted else None
        return self.mode if self.mode in admitted else None


def requested_reuse(request: Any) -> RequestedReuse:
    """The reuse `request` opted into (exact unless it asked for "gated" exactly)."""
    params = getattr(request, "kv_transfer_params", None)
    if params is None:
        return RequestedReuse()
    if not isinstance(params, dict):
        return RequestedReuse(problem=f"kv_transfer_params is a {type(params).__name__}")
    ours = params.get(KEY)
    if ours is None:
        return RequestedReuse()
    if not isinstance(ours, dict):
        return RequestedReuse(problem=f'kv_transfer_params["{KEY}"] must be an object')
    unknown = sorted(set(ours) - {"reuse"})
    if unknown:
        return RequestedReuse(problem=f'kv_transfer_params["{KEY}"] has unknown keys {unknown}')
    mode = ours.get("reuse", EXACT)
    if mode not in REUSE_VALUES:
        return RequestedReuse(problem=f"reuse {mode!r} not in {REUSE_VALUES}")
    return RequestedReuse(mode)


def asked(request: Any) -> bool:
    """Whether `request` named a reuse mode (it is then told what it got)."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and KEY in params
