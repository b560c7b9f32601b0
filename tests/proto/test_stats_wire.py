"""The Stats RPC carries every counter of `NamespaceStats`: the ones older clients know in their
own fields, any other in the `counters` map; a counter this side does not define is ignored."""

from __future__ import annotations

import pytest

from kvsplice.common.namespace_stats import COUNTERS, NamespaceStats
from kvsplice.proto import stats_wire
from kvsplice.proto import store_pb2 as pb

STATS = NamespaceStats(
    num_segments=3, num_bytes=4096, num_hits=5, num_misses=2, num_evictions=1,
    num_refused_puts=1, num_calls=4, num_prompt_tokens=100,
    hit_tokens={"local": 10, "in_place": 20, "grpc": 30},
)  # fmt: skip


def test_a_round_trip_keeps_every_counter_in_the_fields_older_clients_read() -> None:
    response = stats_wire.stats_response(STATS)
    assert stats_wire.stats_of(response) == STATS
    assert (response.num_bytes, response.num_prompt_tokens) == (4096, 100)
    assert (response.num_local_hit_tokens, response.num_grpc_hit_tokens) == (10, 30)


def test_a_counter_without_a_field_travels_in_the_map(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats_wire, "_OWN_FIELDS", stats_wire._OWN_FIELDS - {"num_calls"})
    response = stats_wire.stats_response(STATS)
    assert (response.num_calls, response.counters["num_calls"]) == (0, 4)
    assert stats_wire.stats_of(response) == STATS


def test_a_counter_this_side_does_not_define_is_ignored() -> None:
    response = pb.StatsResponse(num_segments=1, counters={"num_from_the_future": 7})
    assert stats_wire.stats_of(response) == NamespaceStats(
        num_segments=1, hit_tokens={"local": 0, "in_place": 0, "grpc": 0}
    )
    assert "num_from_the_future" not in COUNTERS
