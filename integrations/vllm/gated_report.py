"""What a request that asked for approximate reuse is told it got, and why not more.

The connector answers in the response's `kv_transfer_params` (`reuse_report`):
the tokens loaded exactly and approximately and, when no approximate token was loaded, the
reason in words (`reason`). A connector loads a run from the prompt's start on, so what a
request can get is bounded by its exact prefix: an agent whose own system prompt was never
computed anywhere loads nothing after it. Owns the words, not the state they describe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvsplice.common.reuse_modes import ANCHOR
from kvsplice.integrations.vllm.reuse_request import KEY, RequestedReuse


@dataclass(frozen=True)
class GatedOutcome:
    """What the scheduler half knew of one gated request when it finished."""

    admitted: bool  # the engine's policy admits approximate runs
    looked_up: bool  # the sidecar answered its lookup in time
    num_prefix_tokens: int  # the exact prefix the sidecar holds
    num_found_runs: int  # approximate runs found past that prefix
    num_promised_runs: int  # of those, loaded (whole blocks past what the engine had)
    num_approximate_tokens: int
    load_failed: bool  # a load of this request failed (recomputed)
    mode: str | None = None  # the approximate mode it ran (None: exact reuse)
    refusal: str | None = None  # why the anchor gate refused its runs (recomputed: exact)


def reason(outcome: GatedOutcome) -> str | None:
    """Why `outcome` holds no approximate token (None: it holds some)."""
    if outcome.num_approximate_tokens > 0:
        return None
    if not outcome.admitted:
        return "the engine's admission policy admits no approximate mode: exact reuse only"
    if not outcome.looked_up:
        return "the sidecar did not answer the lookup in time"
    if outcome.load_failed:
        return "loading failed: the request was recomputed"
    if outcome.refusal is not None:
        return (
            f"the anchor gate refused ({outcome.refusal}): the runs found were recomputed "
            "(exact reuse), and become anchors for the requests after it"
        )
    if outcome.num_found_runs == 0 and outcome.num_prefix_tokens == 0:
        return (
            "the prompt's start is not stored: a connector loads from the start on, so the "
            "text before the shared context (e.g. this agent's system prompt) must have been "
            "computed once (warm each persona)"
        )
    if outcome.num_found_runs == 0:
        return "no stored run continues the stored prefix (or the search ran out of time)"
    return "the runs found add no whole block past what the engine already had"


def reuse_report(
    reuse: RequestedReuse, outcome: GatedOutcome, num_exact_tokens: int
) -> dict[str, Any]:
    """What a request that named a reuse mode is told it got (the response's
    `kv_transfer_params`): the mode, whether admitted, the tokens loaded each way, what
    was wrong with its params, and for a gated request that got nothing approximate, why."""
    report: dict[str, Any] = {
        "reuse": reuse.mode,
        "admitted": outcome.admitted,
        "exact_tokens": num_exact_tokens,
        "approximate_tokens": outcome.num_approximate_tokens,
    }
    if outcome.mode == ANCHOR:  # NOTE: naive, the engines' first mode, goes unnamed (as
        report["mode"] = outcome.mode  # before the anchor mode: reports compared whole)
    if reuse.problem:
        report["problem"] = reuse.problem
    if reuse.approximate:
        why = reason(outcome)
        if why is not None:
            report["reason"] = why
    return {KEY: report}
