"""One lookup against the sidecar: a degraded answer is a fault, a failed search keeps the prefix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvsplice.common.errors import StoreUnavailable
from kvsplice.integrations.vllm.lookups import Found, LookupQuery
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.store_lookup import StoreLookup
from kvsplice.storeclient.results import PrefixLookup

FINGERPRINT = "kvfp1-" + "34" * 16
PREFIX = PrefixLookup((), 0)


class Store:
    def __init__(self, degrade: bool = False) -> None:
        self.counters = SimpleNamespace(num_degraded_calls=0)
        self.degrade = degrade

    def lookup_prefix(self, root: str, token_ids: list[int], session_id: str = "") -> PrefixLookup:
        self.counters.num_degraded_calls += self.degrade  # the client answered a miss itself
        return PREFIX

    def find_similar(
        self, root: str, window: list[int], limit: int, with_token_ids: bool = False
    ) -> list[object]:
        raise RuntimeError("search index down")


def lookup_in(store: Store, faults: FaultLog) -> StoreLookup:
    clients = SimpleNamespace(for_namespace=lambda namespace: store)
    return StoreLookup(
        clients,
        block_size=4,
        chunk_tokens=8,
        timeout_s=2.0,
        faults=faults,  # type: ignore[arg-type]
    )


def test_an_exact_query_asks_the_prefix_only_and_a_degraded_one_is_a_fault() -> None:
    query = LookupQuery("ns", FINGERPRINT, 20)
    assert lookup_in(Store(), FaultLog())(query, list(range(20))) == Found(PREFIX)
    with pytest.raises(StoreUnavailable):
        lookup_in(Store(degrade=True), FaultLog())(query, list(range(20)))


def test_a_failing_search_for_runs_leaves_the_exact_prefix_standing() -> None:
    faults = FaultLog()
    query = LookupQuery("ns", FINGERPRINT, 20, approximate=True)
    assert lookup_in(Store(), faults)(query, list(range(20))) == Found(PREFIX)
    assert faults.counts["looking up approximate runs failed"] == 1
