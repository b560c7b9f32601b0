"""A sidecar started during or after a failover knows the cluster's history once it is ready;
a key its catalog does not know is read through to the cluster."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from helpers.cluster import (
    FINGERPRINT,
    NAMESPACE,
    chain_tokens,
    health_status,
    make_chain,
    make_client,
    readyz,
    shared_config,
)
from helpers.waiting import wait_for

from kvsplice.eval.bench.shared.load import read_back
from kvsplice.server.embedded import EmbeddedStore
from kvsplice.storage.keyspace import segment_key

pytestmark = pytest.mark.redis


def master_of(cluster, key: bytes) -> int:
    """The port of the master serving `key`'s slot now."""
    with redis.RedisCluster(host="127.0.0.1", port=cluster.masters()[0]) as client:
        return client.get_node_from_key(key).port


def found_and_read(sidecar: EmbeddedStore, chain) -> tuple[int, int]:
    """(tokens the sidecar finds of `chain`, segments it reads back byte-identical)."""
    with make_client(sidecar) as client:
        match = client.lookup_prefix(FINGERPRINT, chain_tokens(chain))
    return match.num_matched_tokens, len(chain) - read_back([sidecar.target], NAMESPACE, chain)


def assert_ready_and_complete(sidecar: EmbeddedStore, chain) -> None:
    """Ready means caught up: the whole chain is found and read at once."""
    found = found_and_read(sidecar, chain)
    status, ready = readyz(sidecar)
    assert (health_status(sidecar), status, ready["shared_tier"]["caught_up"]) == (
        "SERVING", 200, True
    )  # fmt: skip
    assert found == (768, 24)


def sidecar_after_lost_events(start_sidecar, config, chain):
    """Sidecar "c", started after a sidecar "a" put `chain` and its namespace's events were
    dropped (trimmed off the stream, say): "c" learns of the chain only from the records."""
    a = start_sidecar("a", config)
    with make_client(a) as client_a:
        assert all(client_a.put_segment(meta, payload) for meta, payload in chain)
    shared = a.server.store.shared
    assert shared.wait_published(5.0)
    shared.connection.call("del", lambda c: c.delete(shared._events.stream_name(NAMESPACE)))
    return start_sidecar("c", config)


def test_sidecars_started_during_and_after_a_failover_find_and_read_the_whole_chain(
    cluster, key_prefix, start_sidecar
) -> None:
    config = shared_config(cluster.url, key_prefix)  # every seed, the victim's included
    a, b = start_sidecar("a", config), start_sidecar("b", config)
    chain = make_chain(24, tokens_per_segment=32, seed=25)
    with make_client(a) as client_a:
        assert all(client_a.put_segment(meta, payload) for meta, payload in chain)
    assert a.server.store.shared.wait_published(5.0)
    wait_for(lambda: found_and_read(b, chain), lambda found: found == (768, 24), timeout_s=2.0)
    # the master holding the namespace's event stream: every catch-up must read from it
    victim = master_of(cluster, a.server.store.shared._events.stream_name(NAMESPACE))
    replica = cluster.replica_of(victim)
    cluster.pause(replica)  # no failover before the sidecars below meet the dead master
    cluster.kill(victim)
    try:
        # allowed 0.2 s: it serves first and says it has not read the history (no "done")
        impatient = start_sidecar("impatient", config, catch_up_timeout_s=0.2)
        assert readyz(impatient)[1]["shared_tier"]["caught_up"] is False
        with ThreadPoolExecutor(1) as starter:
            starting = starter.submit(start_sidecar, "during", config)  # meets the dead master
            time.sleep(0.5)
            assert not starting.done()  # its start waits out the failover...
            cluster.resume(replica)
            during = starting.result(timeout=30)
        assert_ready_and_complete(during, chain)  # ...so nothing is waited for after it
        cluster.wait_promoted(victim, timeout_s=15.0)
        after = start_sidecar("after", config)  # the replica took over before it started
        assert_ready_and_complete(after, chain)
        # the follower finishes what the impatient one's catch-up left
        wait_for(lambda: readyz(impatient)[1]["shared_tier"]["caught_up"], bool, timeout_s=5.0)
        assert found_and_read(impatient, chain) == (768, 24)
    finally:
        cluster.resume(replica)
        cluster.restart(victim)  # rejoins as a replica: later tests get a whole cluster
        cluster.wait_healthy()


def test_a_key_the_catalog_never_heard_of_is_read_through_to_the_cluster(
    cluster, key_prefix, start_sidecar
) -> None:
    chain = make_chain(3, seed=26)
    c = sidecar_after_lost_events(start_sidecar, shared_config(cluster.url, key_prefix), chain)
    keys = [segment_key(NAMESPACE, meta.context_key) for meta, _ in chain]
    assert [c.server.store.get_meta(NAMESPACE, m.context_key) for m, _ in chain] == [None] * 3
    assert read_back([c.target], NAMESPACE, chain) == 0  # read through, byte-identical
    assert all(c.server.store._stack.durable.contains(key) for key in keys)  # and cached
    with make_client(c) as client_c:  # and indexed: the chain is found now
        wait_for(
            lambda: client_c.lookup_prefix(FINGERPRINT, chain_tokens(chain)).num_matched_tokens,
            lambda n: n == len(chain_tokens(chain)),
            timeout_s=1.0,
        )
        assert client_c.delete(chain[0][0].context_key)  # deleted here: never resurrected
        assert client_c.get_segment(chain[0][0].context_key) is None


def test_a_lookup_past_what_the_index_knows_reads_the_chain_through_from_the_cluster(
    cluster, key_prefix, start_sidecar
) -> None:
    chain = make_chain(24, tokens_per_segment=32, seed=27)
    c = sidecar_after_lost_events(start_sidecar, shared_config(cluster.url, key_prefix), chain)
    own = make_chain(1, tokens_per_segment=32, seed=28)  # c's workers chunk by 32 tokens too
    with make_client(c) as client_c:
        assert client_c.put_segment(*own[0])
        assert (
            client_c.lookup_prefix(FINGERPRINT, chain_tokens(chain)[:40]).num_matched_tokens == 32
        )
        assert found_and_read(c, chain) == (768, 24)
        # degraded: no probe is sent, the lookup answers from the index alone
        c.server.store.shared.connection.breaker.trip(ConnectionError("test: cluster away"))
        other = make_chain(2, tokens_per_segment=32, seed=29)
        assert client_c.lookup_prefix(FINGERPRINT, chain_tokens(other)).num_matched_tokens == 0
        assert client_c.lookup_prefix(FINGERPRINT, chain_tokens(chain)).num_matched_tokens == 768


def test_a_sidecar_that_indexed_nothing_walks_the_chain_with_the_clusters_lengths(
    cluster, key_prefix, start_sidecar
) -> None:
    chain = make_chain(6, tokens_per_segment=24, seed=30)
    c = sidecar_after_lost_events(
        start_sidecar, shared_config(cluster.url, key_prefix), chain
    )  # no event, no segment: its index knows no length
    assert c.server.segments._exact.segment_lengths(NAMESPACE, 4) == ()
    assert c.server.store.shared.lengths.commonest(NAMESPACE, 4) == (24,)
    assert found_and_read(c, chain) == (6 * 24, 6)


def test_the_clusters_lengths_are_the_commonest_first_and_read_at_most_once_a_second(
    cluster, key_prefix, start_sidecar
) -> None:
    shared = start_sidecar("a", shared_config(cluster.url, key_prefix)).server.store.shared
    lengths = shared.lengths
    for length, num_puts in ((16, 3), (7, 1), (32, 3), (5, 2)):
        for _ in range(num_puts):
            lengths.record(NAMESPACE, length)
    name = lengths.hash_name(NAMESPACE)
    shared.connection.call("hset", lambda c: c.hset(name, "garbage", "x"))  # skipped
    assert lengths.commonest(NAMESPACE, 3) == (16, 32, 5)  # ties: the shorter first
    lengths.record(NAMESPACE, 7)
    lengths.record(NAMESPACE, 7)
    lengths.record(NAMESPACE, 7)
    assert lengths.commonest(NAMESPACE, 4) == (16, 32, 5, 7)  # cached: read a second ago
    wait_for(lambda: lengths.commonest(NAMESPACE, 4), lambda got: got[0] == 7, timeout_s=3.0)
    assert lengths.commonest("tenant-never-written", 4) == ()
