"""`NamespaceStats` (common/namespace_stats.py) to and from the Stats RPC's `StatsResponse`.

A counter travels in the message's field of its name when it has one (the counters older
clients know), else in `counters` by name; reused tokens travel as `num_<served>_hit_tokens`.
A counter a newer server sends that this side does not define is ignored.
"""

from __future__ import annotations

from typing import Any

from kvsplice.common.namespace_stats import COUNTERS, NamespaceStats, counters
from kvsplice.common.reuse_report import SERVED, Served
from kvsplice.proto import store_pb2 as pb

_OWN_FIELDS = frozenset(pb.StatsResponse.DESCRIPTOR.fields_by_name)


def _hit_field(served: Served) -> str:
    return f"num_{served}_hit_tokens"


def stats_response(stats: NamespaceStats) -> pb.StatsResponse:
    response = pb.StatsResponse()
    for name, value in counters(stats).items():
        if name in _OWN_FIELDS:
            setattr(response, name, value)
        else:
            response.counters[name] = value
    for served in SERVED:
        setattr(response, _hit_field(served), stats.hit_tokens.get(served, 0))
    return response


def stats_of(response: pb.StatsResponse) -> NamespaceStats:
    hit_tokens = {served: getattr(response, _hit_field(served)) for served in SERVED}
    values: dict[str, Any] = {
        name: getattr(response, name) if name in _OWN_FIELDS else response.counters.get(name, 0)
        for name in COUNTERS
    }
    return NamespaceStats(**values, hit_tokens=hit_tokens)
