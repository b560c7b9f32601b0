"""The save ledger: one put per chunk at a time, stored once acknowledged, corrupt segments cut."""

from __future__ import annotations

import pytest

from kvsplice.integrations.vllm import save_ledger
from kvsplice.integrations.vllm.lookups import Found
from kvsplice.integrations.vllm.save_ledger import SaveLedger
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.storeclient.results import PrefixLookup, SegmentRef

A, B = ("ns", b"a" * 32), ("ns", b"b" * 32)


def test_a_chunk_is_claimed_once_until_its_put_fails_or_is_acknowledged() -> None:
    ledger = SaveLedger()
    assert ledger.claim(A, 0) and not ledger.claim(A, 0)  # in flight: not put twice
    ledger.fail([A])
    assert ledger.claim(A, 0)  # failed: put again
    ledger.acknowledge([A])
    assert not ledger.claim(A, 0)  # acknowledged after that lookup: stored
    assert ledger.claim(A, ledger.seq)  # a later lookup did not find it: evicted, put again


def test_what_a_lookup_found_counts_as_stored_for_requests_looked_up_before() -> None:
    ledger = SaveLedger()
    before = ledger.found_stored(())
    after = ledger.found_stored((A,))
    assert after == before + 1
    assert not ledger.claim(A, before) and ledger.claim(A, after)
    assert ledger.found_stored(()) == after  # nothing found: no new round


def test_a_claim_no_worker_answers_expires(monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = SaveLedger()
    assert ledger.claim(A, 0)
    now = save_ledger.time.monotonic()
    monkeypatch.setattr(
        save_ledger.time, "monotonic", lambda: now + save_ledger.IN_FLIGHT_TTL_S + 1
    )
    assert ledger.claim(B, 0)  # claimed now: survives the expiry
    ledger.expire()
    assert ledger.claim(A, 0) and not ledger.claim(B, 0)


def test_the_recent_acknowledgements_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(save_ledger, "MAX_RECENT_KEYS", 1)
    ledger = SaveLedger()
    ledger.acknowledge([A])
    ledger.acknowledge([B])
    assert ledger.claim(A, 0) and not ledger.claim(B, 0)  # A forgotten: put again


def test_a_bad_segment_cuts_the_prefix_and_the_runs_until_it_expires(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refs = tuple(SegmentRef(bytes([i]) * 32, 4 * i, 4, 0, 2, 100) for i in range(3))
    spans = (ReusedSpan("run-0", 12, 4, 0, 0), ReusedSpan("run-1", 16, 4, 0, 0))
    found = Found(PrefixLookup(refs, 12), spans)
    ledger = SaveLedger()
    assert ledger.without_bad(found) is found
    ledger.mark_bad(refs[1].segment_id)
    ledger.mark_bad("run-1")
    cut = ledger.without_bad(found)
    assert cut.exact == PrefixLookup(refs[:1], 4) and cut.spans == spans[:1]
    now = save_ledger.time.monotonic()
    monkeypatch.setattr(
        save_ledger.time, "monotonic", lambda: now + save_ledger.BAD_SEGMENT_TTL_S + 1
    )
    assert ledger.without_bad(found) == found  # promised again (deleted meanwhile)
