"""SegmentService: validation, store-then-index, defensive lookups, rebuild, per-namespace stats."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.store import (
    FINGERPRINT,
    NAMESPACE,
    OTHER_FINGERPRINT,
    make_chain,
    make_meta,
    make_payload,
    make_service,
    make_store,
)

from kvsplice.common.errors import (
    CorruptPayload,
    FingerprintMismatch,
    InvalidRequest,
    ResourceExhausted,
)
from kvsplice.common.keys import root_key
from kvsplice.server.config import SegmentServiceConfig
from kvsplice.server.segment_service import SimilarQuery
from kvsplice.storage.config import LMDBTierConfig, StoreConfig, build_store
from kvsplice.storage.tiered_store import TieredStore


def test_put_then_get_returns_the_same_bytes_and_meta() -> None:
    service = make_service()
    payload = make_payload(4096)
    meta = make_meta(range(10, 20), payload)
    service.put(meta, payload)
    stored = service.get(NAMESPACE, meta.context_key, FINGERPRINT)
    assert stored is not None
    assert bytes(stored.payload) == payload
    assert stored.meta.token_ids == meta.token_ids
    assert stored.meta.created_at_s > 0  # set by the server


def test_get_of_an_unknown_key_is_a_miss_not_an_error() -> None:
    assert make_service().get(NAMESPACE, b"\x01" * 16) is None


def test_get_with_another_fingerprint_is_a_fingerprint_mismatch() -> None:
    service = make_service()
    payload = make_payload(64)
    meta = make_meta([1, 2, 3], payload)
    service.put(meta, payload)
    with pytest.raises(FingerprintMismatch):
        service.get(NAMESPACE, meta.context_key, OTHER_FINGERPRINT)


def test_namespaces_never_see_each_other() -> None:
    service = make_service()
    payload = make_payload(64)
    meta = make_meta([1, 2, 3], payload)
    service.put(meta, payload)
    assert service.get("tenant-b", meta.context_key) is None
    assert service.lookup_prefix("tenant-b", FINGERPRINT, [1, 2, 3]).num_matched_tokens == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"checksum": 12345}, "checksum"),
        ({"payload_nbytes": 63}, "payload bytes"),
    ],
)
def test_payload_that_disagrees_with_its_header_is_corrupt(change: dict, message: str) -> None:
    payload = make_payload(64)
    meta = replace(make_meta([1, 2, 3], payload), **change)
    with pytest.raises(CorruptPayload, match=message):
        make_service().put(meta, payload)


def test_header_limits_are_enforced_before_the_payload() -> None:
    config = SegmentServiceConfig(max_payload_nbytes=1024, max_segment_tokens=8, max_layers=32)
    service = make_service(config=config)
    payload = make_payload(16)
    with pytest.raises(InvalidRequest, match="tokens"):
        service.check_header(make_meta(range(9), payload))
    with pytest.raises(InvalidRequest, match="payload_nbytes"):
        service.check_header(replace(make_meta([1], payload), payload_nbytes=1025))
    with pytest.raises(InvalidRequest, match="layers"):
        service.check_header(replace(make_meta([1], payload), layer_end=33))
    with pytest.raises(InvalidRequest, match="payload_nbytes"):
        service.check_header(replace(make_meta([1], payload), payload_nbytes=0))


def test_keys_that_do_not_hash_their_tokens_are_refused() -> None:
    service = make_service()
    payload = make_payload(16)
    honest = make_meta([1, 2, 3], payload)
    forged = replace(honest, token_ids=(9, 9, 9))  # same key, other tokens: poisoning
    with pytest.raises(InvalidRequest, match="context_key"):
        service.check_header(forged)
    with pytest.raises(InvalidRequest, match="starts at 0"):
        service.check_header(replace(honest, start_position=5))


def test_default_ttl_applies_only_when_the_header_has_none() -> None:
    service = make_service(config=SegmentServiceConfig(default_ttl_s=60.0))
    payload = make_payload(16)
    assert service.check_header(make_meta([1], payload)).ttl_s == 60.0
    assert service.check_header(make_meta([1], payload, ttl_s=5.0)).ttl_s == 5.0


@pytest.mark.parametrize("bad_token", [-1, 2**31, 2**40])
def test_lookup_rejects_token_ids_out_of_range(bad_token: int) -> None:
    with pytest.raises(InvalidRequest, match="token id"):
        make_service().lookup_prefix(NAMESPACE, FINGERPRINT, [1, bad_token])


@pytest.mark.parametrize(
    ("namespace", "fingerprint"),
    [("", FINGERPRINT), ("bad/ns", FINGERPRINT), (NAMESPACE, "kvfp1-xyz"), (NAMESPACE, "")],
)
def test_lookup_rejects_bad_namespace_or_fingerprint(namespace: str, fingerprint: str) -> None:
    with pytest.raises(InvalidRequest):
        make_service().lookup_prefix(namespace, fingerprint, [1])


def test_lookup_prefix_finds_the_stored_chain() -> None:
    service = make_service()
    chain = make_chain([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    for meta, payload in chain:
        service.put(meta, payload)
    match = service.lookup_prefix(NAMESPACE, FINGERPRINT, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert match.num_matched_tokens == 9
    assert [m.context_key for m in match.segments] == [m.context_key for m, _ in chain]


def test_lookup_drops_index_entries_the_store_no_longer_holds() -> None:
    store = make_store()
    service = make_service(store)
    chain = make_chain([[1, 2], [3, 4], [5, 6]])
    for meta, payload in chain:
        service.put(meta, payload)
    store.delete(NAMESPACE, chain[1][0].context_key)
    # Drift: the index holds a segment the store lost (the listener had removed it).
    service._exact.add(chain[1][0])
    match = service.lookup_prefix(NAMESPACE, FINGERPRINT, [1, 2, 3, 4, 5, 6])
    assert match.num_matched_tokens == 2  # cut before the lost segment
    assert service._exact.get(NAMESPACE, chain[1][0].context_key) is None


def test_delete_unindexes_and_is_false_the_second_time() -> None:
    service = make_service()
    payload = make_payload(16)
    meta = make_meta([1, 2], payload)
    service.put(meta, payload)
    assert service.delete(NAMESPACE, meta.context_key) is True
    assert service.delete(NAMESPACE, meta.context_key) is False
    assert service.lookup_prefix(NAMESPACE, FINGERPRINT, [1, 2]).num_matched_tokens == 0
    assert service.find_similar(SimilarQuery(NAMESPACE, FINGERPRINT, (1, 2))) == []


def test_indexes_are_rebuilt_from_a_reopened_store(tmp_path) -> None:
    store = make_store(str(tmp_path))
    chain = make_chain([[1, 2, 3], [4, 5, 6]])
    first = make_service(store)
    for meta, payload in chain:
        first.put(meta, payload)
    store.close()
    reopened = make_service(make_store(str(tmp_path)))
    assert reopened.is_ready() is False
    assert reopened.rebuild_indexes() == 2
    assert reopened.is_ready() is True
    assert (
        reopened.lookup_prefix(NAMESPACE, FINGERPRINT, [1, 2, 3, 4, 5, 6]).num_matched_tokens == 6
    )


def test_find_similar_verifies_and_limits() -> None:
    service = make_service(
        config=SegmentServiceConfig(max_similar_limit=4, default_similar_limit=2)
    )
    tokens = tuple(range(100, 140))
    for i in range(3):
        payload = make_payload(32, seed=i)
        parent = root_key(FINGERPRINT) if i == 0 else make_meta([7] * i, payload).context_key
        meta = make_meta(tokens, payload, parent_key=parent, start_position=0 if i == 0 else 10)
        service.put(meta, payload)
    matches = service.find_similar(SimilarQuery(NAMESPACE, FINGERPRINT, tokens))
    assert len(matches) == 2 and all(m.exact_tokens for m in matches)
    with pytest.raises(InvalidRequest, match="limit"):
        service.find_similar(SimilarQuery(NAMESPACE, FINGERPRINT, tokens, limit=5))


def test_stats_are_per_namespace_and_count_hits_and_misses() -> None:
    service = make_service()
    payload = make_payload(100)
    meta = make_meta([1, 2, 3], payload)
    service.put(meta, payload)
    service.lookup_prefix(NAMESPACE, FINGERPRINT, [1, 2, 3])  # hit
    service.lookup_prefix(NAMESPACE, FINGERPRINT, [9])  # miss
    service.get(NAMESPACE, meta.context_key)  # hit
    service.lookup_prefix("tenant-b", FINGERPRINT, [9])  # another tenant's miss
    stats = service.namespace_stats(NAMESPACE)[NAMESPACE]
    assert (stats.num_segments, stats.num_hits, stats.num_misses) == (1, 2, 1)
    assert stats.num_bytes >= 100
    other = service.namespace_stats("tenant-b")["tenant-b"]
    assert (other.num_segments, other.num_hits, other.num_misses) == (0, 0, 1)


@pytest.fixture
def quota_store(tmp_path: Path) -> Iterator[TieredStore]:
    """An LMDB store where NAMESPACE may hold 3000 bytes: about two 1000-byte segments."""
    config = StoreConfig(
        lmdb=LMDBTierConfig(str(tmp_path / "db"), sync=False),
        namespace_quota_bytes={NAMESPACE: 3000},
    )
    store = build_store(config)
    yield store
    store.close()


def test_stats_count_each_namespaces_evictions_and_refused_puts(quota_store: TieredStore) -> None:
    service = make_service(quota_store)
    for i in range(4):
        payload = make_payload(1000, seed=i)
        service.put(make_meta([i + 1], payload), payload)
    big = make_payload(5000)
    with pytest.raises(ResourceExhausted):
        service.put(make_meta([99], big), big)
    stats = service.namespace_stats(NAMESPACE)[NAMESPACE]
    assert stats.num_segments == 2 and stats.num_evictions == 2
    assert stats.num_refused_puts == 1


@pytest.mark.parametrize("listed", [True, False])
def test_a_segment_a_lookup_listed_counts_as_used_for_eviction(
    quota_store: TieredStore, listed: bool
) -> None:
    # Workers read listed segments in place or from their own tier, never through `get`:
    # the listing itself must keep the segment warm, or the hottest chains go first.
    service = make_service(quota_store)
    older, newer, third = ([7, i] for i in range(3))
    metas = []
    for i, tokens in enumerate((older, newer)):
        payload = make_payload(1000, seed=i)
        metas.append(make_meta(tokens, payload))
        service.put(metas[-1], payload)
    if listed:
        assert service.lookup_prefix(NAMESPACE, FINGERPRINT, older).num_matched_tokens == 2
    payload = make_payload(1000, seed=9)
    service.put(make_meta(third, payload), payload)  # evicts one of the two
    survivors = {m.token_ids for m in metas if quota_store.get_meta(NAMESPACE, m.context_key)}
    assert survivors == ({tuple(older)} if listed else {tuple(newer)})
