"""`PlannedCall`: what a plan returns stays as it was returned."""

from __future__ import annotations

import pytest

from kvsplice.client.execute.plan import CallPlan
from kvsplice.client.modes.base import PlannedCall


def test_decisions_are_a_read_only_copy() -> None:
    decided = {"anchor_gate": "confident"}
    planned = PlannedCall(CallPlan.all_compute((1, 2, 3)), decisions=decided)
    decided["anchor_gate"] = "ambiguous"
    assert planned.decisions == {"anchor_gate": "confident"}
    with pytest.raises(TypeError):
        planned.decisions["anchor_gate"] = "ambiguous"  # type: ignore[index]


def test_a_plain_plan_has_no_run_records_decisions_or_memo() -> None:
    planned: PlannedCall[None] = PlannedCall(CallPlan.all_compute((1, 2, 3)))
    assert (planned.result, planned.records, dict(planned.decisions), planned.memo) == (
        None, (), {}, None,
    )  # fmt: skip
