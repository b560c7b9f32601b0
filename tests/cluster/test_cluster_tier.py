"""The Redis tier on a real Cluster: binary keys (braces too) land by their hash tag,
every primary is scanned, a record never spans slots, and a client stuck on a dead node
never keeps the tier degraded while the cluster answers."""

from __future__ import annotations

import pytest
import redis
from helpers.cluster import shared_config
from helpers.waiting import wait_for
from redis.cluster import RedisCluster

from kvsplice.storage.config import RedisTierConfig
from kvsplice.storage.redis_connection import RedisConnection, cluster_seeds
from kvsplice.storage.redis_tier import RedisTier

pytestmark = pytest.mark.redis

KEYS = [b"{a}", b"s\x00ns\x00" + bytes(range(16)), b"}{", b"plain"] + [
    b"k%d" % i for i in range(40)
]


def test_binary_keys_round_trip_across_every_primary(cluster, key_prefix) -> None:
    tier = RedisTier(RedisTierConfig(url=cluster.url, cluster=True, key_prefix=key_prefix))
    try:
        for i, key in enumerate(KEYS):
            tier.put(key, b"value-%d" % i)
        assert sorted(tier.keys()) == sorted(KEYS)
        assert sorted(tier.keys(b"k1")) == sorted(k for k in KEYS if k.startswith(b"k1"))
        assert bytes(tier.get(b"}{")) == b"value-2"
        assert tier.get_prefix(b"{a}", 3) == b"val"
        client = RedisCluster(startup_nodes=cluster_seeds(cluster.url))
        slots = {client.keyslot(tier._full(key)) for key in KEYS}
        tagged = {client.keyslot(tier._full(key).split(b"}")[0] + b"}") for key in KEYS}
        assert slots == tagged and len(slots) > 10  # placed by the tag, spread over slots
        owners = {client.get_node_from_key(tier._full(key)).name for key in KEYS}
        assert len(owners) == cluster.num_masters
        client.close()
        assert tier.delete(b"{a}") and tier.get(b"{a}") is None
    finally:
        tier.close()


def test_cluster_seeds_parse_every_host() -> None:
    seeds = cluster_seeds("redis://user:pw@10.0.0.1:7000,10.0.0.2:7001")
    assert [(s.host, s.port) for s in seeds] == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    with pytest.raises(ValueError, match="not host:port"):
        cluster_seeds("redis://10.0.0.1")


def test_replica_reads_find_what_the_primaries_hold(cluster, key_prefix) -> None:
    writer = RedisTier(RedisTierConfig(url=cluster.url, cluster=True, key_prefix=key_prefix))
    config = RedisTierConfig(
        url=cluster.url, cluster=True, key_prefix=key_prefix, read_from_replicas=True
    )
    reader = RedisTier(config)
    try:
        for i, key in enumerate(KEYS):
            writer.put(key, b"value-%d" % i)
        for port in cluster.masters():  # replicas acknowledge the writes so far
            with redis.Redis(port=port) as primary:
                primary.wait(1, 2000)
        for _ in range(2):  # round robin over the primary and replicas redis-py knows of
            assert [bytes(reader.get(key)) for key in KEYS] == [
                b"value-%d" % i for i in range(len(KEYS))
            ]
    finally:
        writer.close()
        reader.close()


def test_a_client_stuck_on_a_dead_node_is_replaced_once_the_cluster_answers(
    cluster, key_prefix
) -> None:
    connection = RedisConnection(shared_config(cluster.url, key_prefix))
    stuck = connection._client
    assert stuck is not None

    def dead_node_ping(*args: object, **kwargs: object) -> bool:
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")

    # as a client whose default node died and was never replaced (a stale topology)
    stuck.ping = dead_node_ping  # type: ignore[method-assign]
    connection.breaker.trip(redis.ConnectionError("test: two calls failed"))
    try:
        wait_for(lambda: connection.breaker.is_open, lambda is_open: not is_open, timeout_s=10.0)
        assert connection._client is not stuck
        assert connection.call("ping", lambda client: client.ping())
    finally:
        connection.close()
