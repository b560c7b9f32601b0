"""What a policy planned for one call: the plan, its run when already made, and what goes with it.

Owns `PlannedCall`, the value `ReusePolicy.plan` returns and its `after_call` gets back.
It decides nothing and runs nothing: the engine hands its plan (and run) to the executor
and its decisions to the call's outcome.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Generic, TypeVar

from kvsplice.client.execute.layerwise_result import LayerwiseResult
from kvsplice.client.execute.plan import CallPlan
from kvsplice.client.store.segment_io import SpanRecord

logger = logging.getLogger(__name__)

Memo = TypeVar("Memo")


@dataclass(frozen=True, eq=False)
class PlannedCall(Generic[Memo]):
    """One call's plan and what the policy leaves with it; immutable once returned.

    result: `plan`'s run through the decoder layers when the policy already ran it (to
    test it); the executor continues from it instead of running `plan` again (None: not run).
    records: K/V the policy computed while planning (a placeholder's standalone base),
    put by its `after_call` after the first token, before the call's own segments.
    decisions: what it decided and why, for the call's outcome (e.g.
    {"anchor_gate": "ambiguous"}, {"halo_acceptance": "rejected"}).
    memo: what `plan` leaves for the policy's own `after_call` (None: nothing).
    """

    plan: CallPlan
    result: LayerwiseResult | None = None
    records: tuple[SpanRecord, ...] = ()
    decisions: Mapping[str, str] = field(default_factory=dict)
    memo: Memo | None = None

    def __post_init__(self) -> None:
        # NOTE: a read-only copy, so neither the policy nor the engine can change a
        # planned call's decisions after the fact (the dataclass is frozen, a dict is not).
        object.__setattr__(self, "decisions", MappingProxyType(dict(self.decisions)))
