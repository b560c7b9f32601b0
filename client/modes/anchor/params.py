"""anchor's parameters: the one `Params` the policy, its pools and bases read directly.

Owns the fields and their checks only; what each does is said where it is read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvsplice.client.modes.params import check_ranges, knob
from kvsplice.kvmath.quant import check_quant

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Params:
    """anchor's parameters (`anchor:gamma=0.5+tau=0.1+metric=key+r=0.15+cover=0.5+pool=1`).

    The knobs: the gate's γ, metric and weight temperature τ; repair_ratio: CacheBlend on
    the corrected K/V (None: they are read at every layer). Every corrected token is
    computed through layer 1 and the `repair_ratio` share deviating most from the
    correction is computed above it: KVComm's correction as the starting point, blend's
    selective recompute for what the correction still gets wrong. min_coverage: 1.0 is
    KVComm's length rule (anchors at least as long as the placeholder); below it, a
    placeholder longer than all but one anchor has its first tokens corrected if they
    are at least this share (`pools.coverage`). pool_judges: PAL-KV (seed 001): when the
    call is judge-like (`risk_gate.classify`), retrieval ignores agent identity (any
    agent's offsets, its own first) and each answer placeholder retrieves from the union
    of the pools of all the prompt's answer placeholders. The gate, weights and
    correction stay KVComm's.

    Set in code only (`variant=False`): quant, the anchor payloads' scheme. base_lead: text
    prefilled before each placeholder's base and dropped (KVComm prefills its question bases
    after the user header). Without it the base's first token is an attention sink whose K/V
    nothing in a real prompt resembles, and every offset (real − base) inherits that
    difference. The same for every agent, so one base serves all of an anchor's offsets.
    sender_bases: answers' bases are their senders' K/V (False: lead prefills).
    max_anchor_nbytes: an anchor whose base plus one agent's offsets would exceed it is not
    stored (the store refuses more than its own limit, 256 MiB by default).
    decoded_cache_bytes: decoded anchors kept in the worker between calls
    (`pools.DecodedAnchors`; 0: fetched and decoded on every call).
    """

    gamma: float = knob(
        0.3, "gamma", "the gate's entropy threshold factor (H > γ·log2|A| → dense)",
        low=0, high=1, grid=(0.3, 0.5, 1.0), symbol="γ",
    )  # fmt: skip
    tau: float = knob(0.1, "tau", "the anchor weights' temperature", low=0, low_open=True)
    metric: str = knob("value", "metric", "the gate's distance", choices=("value", "key"))
    repair_ratio: float | None = knob(
        None, "r", "CacheBlend's ratio on the corrected K/V, or none (no repair)",
        low=0, high=1, grid=(0.15,), grid_with={"gamma": 1.0},
    )  # fmt: skip
    min_coverage: float = knob(
        1.0, "cover", "the share of a placeholder its anchors must cover (1: KVComm's length rule)",
        low=0, low_open=True, high=1,
    )  # fmt: skip
    pool_judges: int = knob(
        0, "pool", "PAL-KV: 1 pools a judge-like call's answer anchors across placeholders "
        "and agents; 0: KVComm's per-placeholder, per-agent pools", low=0, high=1,
    )  # fmt: skip
    quant: str = knob("int8", "quant", "the anchor payloads' scheme", variant=False)
    base_lead: str = knob(
        "<|im_start|>user\n", "lead", "text prefilled before each base", variant=False
    )
    sender_bases: bool = knob(True, "sender_bases", "answers' bases: senders' K/V", variant=False)
    max_anchor_nbytes: int = knob(
        (256 << 20) - (64 << 10), "max_bytes", "largest anchor stored", variant=False
    )
    decoded_cache_bytes: int = knob(
        256 << 20, "cache_bytes", "decoded anchors kept between calls", variant=False
    )

    def __post_init__(self) -> None:
        check_ranges(self)
        check_quant(self.quant)
        if self.decoded_cache_bytes < 0:
            raise ValueError(f"decoded_cache_bytes {self.decoded_cache_bytes} must be >= 0")
        if self.max_anchor_nbytes < 1:
            raise ValueError(f"max_anchor_nbytes {self.max_anchor_nbytes} must be >= 1")
