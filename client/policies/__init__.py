"""Reuse policies: one module per mode; `make_policy` builds one by name."""

from __future__ import annotations

from kvsplice.client.policies.base import (
    CallContext,
    PlanBuilder,
    PromptSpan,
    ReusePolicy,
    SpannedPrompt,
    span_role,
)
from kvsplice.client.policies.dense import DensePolicy
from kvsplice.client.policies.exact import ExactPolicy
from kvsplice.client.policies.naive import NaivePolicy

POLICIES: dict[str, type[DensePolicy | ExactPolicy | NaivePolicy]] = {
    "dense": DensePolicy,
    "exact": ExactPolicy,
    "naive": NaivePolicy,
}
MODES = tuple(POLICIES)


def make_policy(mode: str) -> ReusePolicy:
    """The policy of `mode` (one of `MODES`)."""
    if mode not in POLICIES:
        raise ValueError(f"mode {mode!r} not in {MODES}")
    return POLICIES[mode]()


__all__ = [
    "MODES",
    "CallContext",
    "DensePolicy",
    "ExactPolicy",
    "NaivePolicy",
    "PlanBuilder",
    "PromptSpan",
    "ReusePolicy",
    "SpannedPrompt",
    "make_policy",
    "span_role",
]
