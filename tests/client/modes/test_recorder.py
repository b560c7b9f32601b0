"""What the two recording bases store of a call's records: all of them, handed to the
engine's writer; or, for the policies that compute scattered tokens inside reused spans,
all but the approximate prompt pieces that cover only part of a prompt span."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.text import make_prompt

from kvsplice.client.modes import recorder
from kvsplice.client.modes.blend import BlendPolicy
from kvsplice.client.modes.exact import ExactPolicy
from kvsplice.client.tiers.segment_io import SpanRecord
from kvsplice.common.keys import root_key
from kvsplice.kvmath.segment_kv import SegmentKV

PROMPT = make_prompt([("text", "text_0", "abcd"), ("placeholder", "user_question", "efgh")])


def _record(start: int, end: int, *, exact: bool, kind: str = "prompt") -> SpanRecord:
    keys = torch.zeros(1, 1, end - start, 2)
    kv = SegmentKV(keys, torch.zeros_like(keys), start_position=start)
    tokens = PROMPT.token_ids[start:end] or (1,) * (end - start)
    return SpanRecord(kv, tokens, root_key("kvfp1-" + "a" * 32), (), kind=kind, exact=exact)  # type: ignore[arg-type]


RECORDS = [
    _record(0, 4, exact=True),  # an exact span: kept
    _record(4, 6, exact=False),  # part of the question, approximate: dropped by whole-span
    _record(4, 8, exact=False),  # the whole question, approximate: kept
    _record(8, 10, exact=False, kind="response"),  # the response: kept
]


def test_a_recording_policy_hands_every_record_to_the_writer() -> None:
    handed: list[SpanRecord] = []
    ctx: Any = SimpleNamespace(writer=SimpleNamespace(submit=handed.extend))
    ExactPolicy().store_records(ctx, PROMPT, None, RECORDS)  # type: ignore[arg-type]
    assert handed == RECORDS


def test_a_whole_span_policy_puts_all_but_partial_approximate_prompt_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    put: list[SpanRecord] = []
    monkeypatch.setattr(recorder, "put_records", lambda _ctx, records: put.extend(records))
    BlendPolicy().store_records(None, PROMPT, None, RECORDS)  # type: ignore[arg-type]
    assert put == [RECORDS[0], RECORDS[2], RECORDS[3]]
