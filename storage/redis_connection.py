"""One Redis/Valkey connection (a single server or a Cluster) behind a circuit breaker.

Owns the redis-py client (created lazily: a server unreachable at start is a degraded
tier, not a crash), the URL schemes, hash-tagged key names and fault mapping. Every
call goes through `call`: connection faults and timeouts raise `StoreUnavailable` and
count toward the breaker; Redis OOM raises `ResourceExhausted`. What keys hold is the
caller's business (`redis_tier`, `segment_events`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import redis
import xxhash
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, LoadBalancingStrategy, RedisCluster
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MasterDownError,
    OutOfMemoryError,
    RedisClusterException,
    TryAgainError,
)
from redis.retry import Retry

from kvsplice.common.breaker import BreakerConfig, BreakerWords, CircuitBreaker
from kvsplice.common.errors import ResourceExhausted, StoreUnavailable
from kvsplice.storage.config import RedisTierConfig

logger = logging.getLogger(__name__)

Client = redis.Redis | RedisCluster
T = TypeVar("T")

# Faults of the tier (count toward the breaker), as opposed to refusals (OOM) and bugs.
TIER_FAULTS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ClusterDownError,
    ClusterError,
    MasterDownError,
    TryAgainError,
    RedisClusterException,
)
_SCHEME_ALIASES = {"valkey://": "redis://", "valkeys://": "rediss://"}


def redis_py_url(url: str) -> str:
    """`url` with a valkey:// or valkeys:// scheme spelled as redis-py knows it."""
    for alias, scheme in _SCHEME_ALIASES.items():
        if url.startswith(alias):
            return scheme + url[len(alias) :]
    return url


def hash_tagged(prefix: bytes, tag_source: bytes, rest: bytes) -> bytes:
    """`prefix{tag}rest`: Cluster hashes only the tag, so a binary `rest` holding braces
    can never pick the slot, and everything named after one tag source shares a slot."""
    return prefix + b"{" + xxhash.xxh3_64_hexdigest(tag_source).encode() + b"}" + rest


TAG_NBYTES = 2 + 16  # the braces and xxh3-64 as hex
TIER_WORDS = BreakerWords(
    opened="{name} unreachable ({error}): degraded, local tiers serve",
    closed="{name} reachable again after {down_s:.1f} s: sharing resumes",
)


class RedisConnection:
    """Calls into Redis through a breaker; `breaker.state` says whether the tier is degraded."""

    def __init__(self, config: RedisTierConfig, name: str = "redis") -> None:
        self.name = name
        self.config = config
        self.breaker = CircuitBreaker(
            f"shared tier {name}",
            BreakerConfig(config.failure_threshold, config.probe_interval_s),
            self._probe,
            TIER_WORDS,
        )
        self._lock = threading.Lock()
        self._client: Client | None = None
        self._closed = False
        try:
            self._connect()
        except TIER_FAULTS as exc:
            logger.warning(
                "%s at %s unreachable at start (%s): starting degraded, connecting when it appears",
                name,
                _redacted(config.url),
                exc,
            )
            self.breaker.trip(exc)

    @property
    def is_connected(self) -> bool:
        """True once a client was created (a server unreachable at start: False until then)."""
        return self._client is not None

    @property
    def is_cluster(self) -> bool:
        return self.config.cluster

    def call(self, operation: str, fn: Callable[[Client], T]) -> T:
        """`fn(client)`, or `StoreUnavailable` at once while the breaker is open."""
        if self._closed:
            raise StoreUnavailable(f"{self.name} tier is closed")
        self.breaker.check()
        client = self._client
        if client is None:
            raise StoreUnavailable(f"{self.name}: not connected yet")
        try:
            result = fn(client)
        except OutOfMemoryError as exc:
            raise ResourceExhausted(f"{self.name}: {operation} refused: {exc}") from exc
        except TIER_FAULTS as exc:
            self.breaker.record_failure(exc)
            raise StoreUnavailable(f"{self.name}: {operation} failed: {exc}") from exc
        self.breaker.record_success()
        return result

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        self.breaker.close()
        if client is not None:
            client.close()

    def _probe(self) -> None:
        client = self._client
        if client is not None:
            try:
                client.ping()
                return
            except TIER_FAULTS:
                if not self.is_cluster:
                    raise
                # NOTE: a cluster client can keep asking a node that died (a dead seed
                # or default node, a stale slot map): a new one learns the topology from
                # any seed that answers, so a healthy cluster always ends the outage.
        self._connect()

    def _connect(self) -> None:
        client = _make_client(self.config)
        try:
            client.ping()
        except BaseException:
            client.close()
            raise
        with self._lock:
            if self._closed:
                client.close()
                return
            # NOTE: a replaced client is left to the garbage collector, not closed: a
            # call that began before the breaker opened may still be using it.
            self._client = client
        logger.info("%s connected (%s)", self.name, "cluster" if self.is_cluster else "single")


def _make_client(config: RedisTierConfig) -> Client:
    url = redis_py_url(config.url)
    timeout_s = config.socket_timeout_s
    if config.cluster:
        # NOTE: MOVED/ASK are followed and the slot map refreshed by RedisCluster
        # itself; its retries (short backoff) ride through a replica's promotion
        # before a fault reaches the breaker.
        return RedisCluster(
            startup_nodes=cluster_seeds(url),
            # reads spread over each slot's primary and replicas (replicas lag by ms)
            load_balancing_strategy=LoadBalancingStrategy.ROUND_ROBIN
            if config.read_from_replicas
            else None,
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 2),
            **_credentials(url),
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )
    # One quick retry: a dead server surfaces within the socket timeout, not after
    # redis-py's default exponential backoff.
    return redis.Redis.from_url(
        url,
        retry=Retry(NoBackoff(), 1),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )


def cluster_seeds(url: str) -> list[ClusterNode]:
    """The seed nodes of `redis://[user:pass@]host:port[,host:port...]` (any one suffices)."""
    hosts = urlsplit(url).netloc.rsplit("@", 1)[-1]
    seeds = []
    for host_port in hosts.split(","):
        host, _, port = host_port.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"cluster seed {host_port!r} in {_redacted(url)} is not host:port")
        seeds.append(ClusterNode(host.strip("[]"), int(port)))
    return seeds


def _credentials(url: str) -> dict[str, Any]:
    parts = urlsplit(url)
    found: dict[str, Any] = {"ssl": parts.scheme == "rediss"}
    if parts.username:
        found["username"] = unquote(parts.username)
    if parts.password:
        found["password"] = unquote(parts.password)
    return found


def _redacted(url: str) -> str:
    """`url` without a password (it would otherwise land in the log)."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.rsplit('@', 1)[1]}"


def reply_bytes(value: bytes | str | None) -> bytes:
    """A Redis reply as bytes. Our clients never set decode_responses (redis-py's types
    allow str for clients that do), so a str, or None where the protocol always answers,
    is a bug, not data."""
    if not isinstance(value, bytes):
        raise TypeError(f"a bytes reply from Redis was expected, got {type(value).__name__}")
    return value
