"""Sessions over gRPC: a put's `SegmentHeader.session_id` and a lookup's `session_id` hold
segments under the session's lease, `RenewSession` answers accepted/clipped/rejected, and
`EndSession` releases them; a reader's session holds nothing."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from helpers.store import FINGERPRINT, make_chain

from kvsplice.common.errors import InvalidRequest
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storage.config import SessionConfig
from kvsplice.storeclient.client import StoreClient


@pytest.fixture
def embedded(tmp_path: Path):
    config = loopback_config(str(tmp_path / "db"))
    store_config = replace(config.store, sessions=SessionConfig(lease_s=60.0, max_lease_s=120.0))
    with EmbeddedStore(replace(config, store=store_config)) as store:
        yield store


def test_puts_and_lookups_of_a_session_hold_segments_until_it_ends(embedded) -> None:
    sessions = embedded.server.store.sessions
    (first, first_payload), (second, second_payload) = make_chain([(1, 2), (3, 4)])
    with StoreClient(embedded.target, first.namespace) as client:
        assert client.put_segment(first, first_payload, session_id="task-1")
        assert client.put_segment(second, second_payload)  # no session: not held
        assert sessions.num_live() == 1
        held = sessions.held_nbytes(first.namespace)
        assert held > 0
        found = client.lookup_prefix(FINGERPRINT, [1, 2, 3, 4], session_id="task-2")
        assert found.num_matched_tokens == 4
        assert sessions.num_live() == 2
        assert sessions.held_nbytes(first.namespace) > held  # the second segment now too
        assert client.end_session("task-1") and client.end_session("task-2")
        assert not client.end_session("task-1")
        assert sessions.num_live() == 0 and sessions.held_nbytes(first.namespace) == 0


def test_renewal_outcomes_come_back_accepted_clipped_or_rejected(embedded) -> None:
    with StoreClient(embedded.target, "tenant-a") as client:
        accepted = client.renew_session("s")
        assert accepted is not None and (accepted.outcome, accepted.lease_s) == ("accepted", 60.0)
        clipped = client.renew_session("s", lease_s=600.0)
        assert clipped is not None and (clipped.outcome, clipped.lease_s) == ("clipped", 120.0)
        rejected = client.renew_session("s", lease_s=-5.0)
        assert rejected is not None and rejected.outcome == "rejected"
        with pytest.raises(InvalidRequest):
            client.renew_session("x" * 300)


def test_a_bad_session_id_is_refused_before_anything_is_stored(embedded) -> None:
    ((meta, payload),) = make_chain([(1, 2)])
    with StoreClient(embedded.target, meta.namespace) as client:
        with pytest.raises(InvalidRequest):
            client.put_segment(meta, payload, session_id="bad\nid")
        with pytest.raises(InvalidRequest):
            client.lookup_prefix(FINGERPRINT, [1, 2], session_id="x" * 300)
        assert client.lookup_prefix(FINGERPRINT, [1, 2]).num_matched_tokens == 0
