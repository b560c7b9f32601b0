"""Sidecars on one Redis Cluster share segments and anchors; restarts catch up."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from helpers.cluster import (
    FINGERPRINT,
    NAMESPACE,
    chain_tokens,
    make_chain,
    make_client,
    readyz,
    shared_config,
)
from helpers.waiting import wait_for

from kvsplice.storage.keyspace import segment_key

pytestmark = pytest.mark.redis


def test_a_chain_put_through_a_is_found_read_and_cached_by_b(
    cluster, key_prefix, start_sidecar
) -> None:
    a = start_sidecar("a", shared_config(cluster.url, key_prefix))
    b = start_sidecar("b", shared_config(cluster.url.replace("redis", "valkey"), key_prefix))
    chain = make_chain(8)
    tokens = chain_tokens(chain)
    with make_client(a) as client_a, make_client(b) as client_b:
        assert all(client_a.put_segment(meta, payload) for meta, payload in chain)
        found = wait_for(  # the timeout is a hang guard, not a latency bound
            lambda: client_b.lookup_prefix(FINGERPRINT, tokens),
            lambda match: match.num_matched_tokens == len(tokens),
            timeout_s=10.0,
        )
        assert len(found.segments) == len(chain)
        for meta, payload in chain:
            read = client_b.get_segment(meta.context_key)
            assert read is not None and read[1] == payload
        similar = client_b.find_similar(FINGERPRINT, chain[3][0].token_ids)
        assert [c.segment.segment_id for c in similar][:1] == [chain[3][0].segment_id]
        b_lmdb = b.server.store._stack.durable
        assert all(b_lmdb.contains(segment_key(NAMESPACE, m.context_key)) for m, _ in chain)
        status, ready = readyz(b)
        assert status == 200 and ready["shared_tier"]["state"] == "connected"
        assert ready["shared_tier"]["cluster"] is True

        # a delete through B reaches A's indexes
        assert client_b.delete(chain[-1][0].context_key)
        wait_for(
            lambda: client_a.lookup_prefix(FINGERPRINT, tokens).num_matched_tokens,
            lambda n: n == len(tokens) - len(chain[-1][0].token_ids),
            timeout_s=1.0,
        )
        assert client_a.get_segment(chain[-1][0].context_key) is None


def test_a_restarted_sidecar_catches_up_with_what_was_put_while_it_was_down(
    cluster, key_prefix, start_sidecar
) -> None:
    config = shared_config(cluster.url, key_prefix)
    a = start_sidecar("a", config)
    b = start_sidecar("b", config)
    first, later = make_chain(6)[:3], make_chain(6)[3:]
    with make_client(a) as client_a:
        assert all(client_a.put_segment(m, p) for m, p in first)
        assert a.server.store.shared.wait_published(5.0)
        b.stop()
        assert all(client_a.put_segment(m, p) for m, p in later)
        assert a.server.store.shared.wait_published(5.0)
    b_again = start_sidecar("b", config)  # same LMDB, restarted
    with make_client(b_again) as client_b:
        tokens = chain_tokens(first + later)
        match = wait_for(
            lambda: client_b.lookup_prefix(FINGERPRINT, tokens),
            lambda found: found.num_matched_tokens == len(tokens),
            timeout_s=2.0,
        )
        assert len(match.segments) == 6
        assert all(client_b.get_segment(m.context_key)[1] == p for m, p in first + later)


def test_anchors_are_shared_and_pools_stay_within_capacity(
    cluster, key_prefix, start_sidecar
) -> None:
    from kvsplice.index.anchor_pool import AnchorPoolConfig

    config = shared_config(cluster.url, key_prefix)
    pool = AnchorPoolConfig(capacity=3, window=2)
    a = start_sidecar("a", config, anchor_pool=pool)
    b = start_sidecar("b", config, anchor_pool=pool)
    with make_client(a) as client_a, make_client(b) as client_b:
        assert client_a.put_anchor(FINGERPRINT, "ph", "anc-0", b"base0", {"x": b"off0"}, 4) == []
        anchors = wait_for(
            lambda: client_b.get_anchors(FINGERPRINT, "ph"),
            lambda found: [e.anchor_id for e in found] == ["anc-0"],
            timeout_s=1.0,
        )
        assert anchors[0].base_payload == b"base0"
        for i in range(1, 5):
            client = (client_a, client_b)[i % 2]
            assert (
                client.put_anchor(FINGERPRINT, "ph", f"anc-{i}", b"b", {"x": b"o"}, 4) is not None
            )
            assert a.server.store.shared.wait_published(5.0)
            assert b.server.store.shared.wait_published(5.0)
            time.sleep(0.2)  # the other sidecar hears of the new pool before it writes
        for client in (client_a, client_b):
            found = wait_for(
                lambda client=client: client.get_anchors(FINGERPRINT, "ph", include_payloads=False),
                lambda entries: len(entries) == 3,
                timeout_s=1.0,
            )
            assert [e.anchor_id for e in found][-1] == "anc-4"


def test_a_segment_put_through_two_sidecars_at_once_reads_everywhere(
    cluster, key_prefix, start_sidecar
) -> None:
    config = shared_config(cluster.url, key_prefix)
    a, b = start_sidecar("a", config), start_sidecar("b", config)
    chain = make_chain(4, seed=7)
    # twins: same keys, another created_at; A's events come first, B's records last,
    # so a newcomer catalogs A's version and finds B's in the cluster
    for sidecar in (a, b):
        with make_client(sidecar) as client:
            assert all(client.put_segment(meta, payload) for meta, payload in chain)
        assert sidecar.server.store.shared.wait_published(5.0)
    c = start_sidecar("c", config)
    with make_client(c) as client_c:
        tokens = chain_tokens(chain)
        assert client_c.lookup_prefix(FINGERPRINT, tokens).num_matched_tokens == len(tokens)
        for meta, payload in chain:
            read = client_c.get_segment(meta.context_key)
            assert read is not None and read[1] == payload


def test_a_full_local_tier_drops_its_copies_only_the_cluster_keeps_serving_them(
    cluster, key_prefix, start_sidecar
) -> None:
    config = shared_config(cluster.url, key_prefix)
    a = start_sidecar("a", config, lmdb_map_bytes=1 << 20, memory_bytes=128 << 10)
    b = start_sidecar("b", config)
    chain = make_chain(24, nbytes=64 * 1024, seed=9)  # 1.5 MiB through a 1 MiB LMDB
    with make_client(a) as client_a:
        assert all(client_a.put_segment(meta, payload) for meta, payload in chain)
        assert a.server.store.shared.wait_published(5.0)
        held = a.server.store._stack.durable
        keys = [segment_key(NAMESPACE, meta.context_key) for meta, _ in chain]
        assert not all(held.contains(key) for key in keys)  # some were dropped locally
        assert a.server.store.stats().removals["capacity"] == 0  # ...not removed
        for meta, payload in chain:  # dropped ones come back from the cluster
            read = client_a.get_segment(meta.context_key)
            assert read is not None and read[1] == payload
    with make_client(b) as client_b:  # B's index follows the cluster's (eventually, see above)
        tokens = chain_tokens(chain)
        wait_for(
            lambda: client_b.lookup_prefix(FINGERPRINT, tokens).num_matched_tokens,
            lambda n: n == len(tokens),
            timeout_s=3.0,
        )


def test_quota_evictions_and_ttl_expiries_reach_the_other_sidecar(
    cluster, key_prefix, start_sidecar
) -> None:
    config = shared_config(cluster.url, key_prefix)
    a = start_sidecar("a", config, quota_bytes=5 * (16 * 1024 + 600))  # ~5 segments
    b = start_sidecar("b", config)
    roots = [make_chain(1, seed=100 + i)[0] for i in range(8)]  # 8 independent segments

    def found_on_b(client) -> list[bool]:
        return [
            client.lookup_prefix(FINGERPRINT, m.token_ids).num_matched_tokens > 0 for m, _ in roots
        ]

    with make_client(a) as client_a, make_client(b) as client_b:
        for meta, payload in roots:
            assert client_a.put_segment(meta, payload)
        # A evicted its 3 oldest for the quota; B hears of it and stops finding them
        wait_for(lambda: found_on_b(client_b), lambda found: found == [False] * 3 + [True] * 5, 2.0)
        assert a.server.store.stats().removals["quota"] == 3

        short, payload = make_chain(1, seed=200)[0]
        assert client_a.put_segment(replace(short, ttl_s=0.5), payload)
        wait_for(lambda: client_b.get_segment(short.context_key), lambda r: r is not None, 1.0)
        time.sleep(0.6)
        assert client_b.get_segment(short.context_key) is None  # expired on B too
        assert client_b.lookup_prefix(FINGERPRINT, short.token_ids).num_matched_tokens == 0
