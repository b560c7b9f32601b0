"""The shared tier: one Redis/Valkey string per sealed record, under a key prefix.

Header and payload travel in ONE value (LMCache's two-key layout broke when the
server evicted one key of a pair). Owns the redis-py client and error mapping:
connection faults raise `StoreUnavailable`, Redis OOM raises `ResourceExhausted`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import redis
from redis.backoff import NoBackoff
from redis.exceptions import OutOfMemoryError
from redis.retry import Retry

from kvsplice.common.errors import CorruptPayload, ResourceExhausted, StoreUnavailable
from kvsplice.storage.config import RedisTierConfig
from kvsplice.storage.record import HEADER_NBYTES, body_prefix, open_record, read_header, seal
from kvsplice.storage.tier import EvictionCallback, TierCounters, TierStats

logger = logging.getLogger(__name__)

_GLOB_SPECIAL = re.compile(rb"([\\*?\[\]])")
_SCAN_COUNT = 1000


def escape_glob(raw: bytes) -> bytes:
    """`raw` as a literal in a Redis MATCH pattern (keys are binary)."""
    return _GLOB_SPECIAL.sub(rb"\\\1", raw)


class RedisTier:
    """`StorageTier` over redis-py; thread-safe through the client's connection pool.

    `used_bytes` is a tracked counter: the bytes of this prefix's records, seeded
    by SCAN + STRLEN at construction and moved by every put/delete made here.
    Records that Redis itself expires (TTL) or evicts (maxmemory), or that other
    processes write, are not tracked until the next construction. Redis never
    tells us what it evicts, so `on_evict` is never called; such records read as
    misses.
    """

    def __init__(
        self,
        config: RedisTierConfig,
        client: redis.Redis | None = None,
        on_evict: EvictionCallback | None = None,
        name: str = "redis",
    ) -> None:
        self.name = name
        self._config = config
        self._owns_client = client is None
        self._client = client if client is not None else _connect(config)
        self._prefix = config.key_prefix.encode()
        self._counters = TierCounters()
        self._lock = threading.Lock()
        self._closed = False
        self._used_nbytes = self._measure_used_bytes()

    def put(self, key: bytes, value: bytes | memoryview) -> None:
        record = seal(value, compress=self._config.compress)
        ttl_ms = None if self._config.ttl_s is None else max(1, int(self._config.ttl_s * 1000))
        with self._translated("put"):
            pipe = self._client.pipeline(transaction=True)
            pipe.strlen(self._full(key))
            pipe.set(self._full(key), record, px=ttl_ms)
            old_nbytes, _ = pipe.execute()
        self._adjust_used(len(record) - int(old_nbytes))
        self._counters.add(puts=1, bytes_in=len(value))

    def get(self, key: bytes) -> bytes | memoryview | None:
        with self._translated("get"):
            raw = self._client.get(self._full(key))
        if raw is None:
            self._counters.add(misses=1)
            return None
        try:
            body = open_record(raw)
        except CorruptPayload as exc:
            self._discard_corrupt(key, exc)
            self._counters.add(misses=1)
            return None
        self._counters.add(hits=1, bytes_out=len(body))
        return body

    def get_prefix(self, key: bytes, max_nbytes: int) -> bytes | None:
        with self._translated("get_prefix"):
            raw = cast(
                "bytes | None",
                self._client.getrange(self._full(key), 0, HEADER_NBYTES + max_nbytes - 1),
            )
            try:
                if raw and read_header(raw).compressed:
                    # a zstd prefix needs only the frame's start, but GETRANGE cannot size it
                    raw = cast("bytes | None", self._client.get(self._full(key)))
                return body_prefix(raw, max_nbytes) if raw else None
            except CorruptPayload as exc:
                corrupt = exc
        self._discard_corrupt(key, corrupt)
        return None

    def delete(self, key: bytes) -> bool:
        with self._translated("delete"):
            pipe = self._client.pipeline(transaction=True)
            pipe.strlen(self._full(key))
            pipe.delete(self._full(key))
            old_nbytes, num_deleted = pipe.execute()
        self._adjust_used(-int(old_nbytes))
        return bool(num_deleted)

    def contains(self, key: bytes) -> bool:
        with self._translated("contains"):
            return bool(self._client.exists(self._full(key)))

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        pattern = escape_glob(self._prefix + prefix) + b"*"
        with self._translated("keys"):
            found = list(self._client.scan_iter(match=pattern, count=_SCAN_COUNT))
        # SCAN may return a key twice (rehashing); dedupe while stripping the prefix.
        return iter(dict.fromkeys(key[len(self._prefix) :] for key in found))

    def used_bytes(self) -> int:
        with self._lock:
            return self._used_nbytes

    def capacity_bytes(self) -> int | None:
        return self._config.max_bytes

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._owns_client:
            self._client.close()

    def stats(self) -> TierStats:
        return self._counters.snapshot()

    def _full(self, key: bytes) -> bytes:
        return self._prefix + key

    def _measure_used_bytes(self) -> int:
        with self._translated("scan"):
            names = list(
                self._client.scan_iter(match=escape_glob(self._prefix) + b"*", count=_SCAN_COUNT)
            )
            pipe = self._client.pipeline(transaction=False)
            for name in dict.fromkeys(names):
                pipe.strlen(name)
            return sum(int(n) for n in pipe.execute())

    def _adjust_used(self, delta: int) -> None:
        with self._lock:
            self._used_nbytes = max(0, self._used_nbytes + delta)

    def _discard_corrupt(self, key: bytes, exc: CorruptPayload) -> None:
        # NOTE: an unconditional DEL may drop a record another process wrote in the
        # meantime; that costs one miss, never a wrong read.
        self.delete(key)
        self._counters.add(checksum_failures=1)
        logger.warning("%s: dropped corrupt record %s: %s", self.name, key.hex(), exc)

    @contextmanager
    def _translated(self, operation: str) -> Iterator[None]:
        if self._closed:
            raise StoreUnavailable(f"{self.name} tier is closed")
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailable(f"{self.name}: {operation} failed: {exc}") from exc
        except OutOfMemoryError as exc:
            raise ResourceExhausted(f"{self.name}: {operation} refused: {exc}") from exc


def _connect(config: RedisTierConfig) -> redis.Redis:
    # One quick retry: a dead server should surface as StoreUnavailable within
    # the socket timeout, not after redis-py's default exponential backoff.
    return redis.Redis.from_url(
        config.url,
        socket_timeout=config.socket_timeout_s,
        socket_connect_timeout=config.socket_timeout_s,
        retry=Retry(NoBackoff(), 1),
    )
