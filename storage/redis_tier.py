"""The shared tier's records: one Redis/Valkey string per sealed record, hash-tagged.

Header and payload travel in ONE value (LMCache's two-key layout broke when the
server evicted one key of a pair). Each key is `prefix{xxh3(key)}key`, so a Cluster
places it by the tag alone. Calls go through `RedisConnection` (timeouts, breaker,
fault mapping); the events that tell other sidecars about records are `segment_events`'.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from typing import Any, cast

from kvsplice.common.errors import CorruptPayload, StoreUnavailable
from kvsplice.storage.config import RedisTierConfig
from kvsplice.storage.record import (
    HEADER_NBYTES,
    SealedRecord,
    as_record,
    body_prefix,
    open_record,
    read_header,
)
from kvsplice.storage.redis_connection import (
    TAG_NBYTES,
    Client,
    RedisConnection,
    hash_tagged,
    reply_bytes,
)
from kvsplice.storage.tier import EvictionCallback, TierCounters, TierStats

logger = logging.getLogger(__name__)

_GLOB_SPECIAL = re.compile(rb"([\\*?\[\]])")
_SCAN_COUNT = 1000


def escape_glob(raw: bytes) -> bytes:
    """`raw` as a literal in a Redis MATCH pattern (keys are binary)."""
    return _GLOB_SPECIAL.sub(rb"\\\1", raw)


class RedisTier:
    """`StorageTier` over one Redis server or a Cluster; thread-safe (redis-py pools).

    `used_bytes` is a tracked counter: the bytes of this prefix's records, seeded
    by SCAN + STRLEN when the tier is reachable at construction and moved by every
    put/delete made here. Records that Redis itself expires (TTL) or evicts
    (maxmemory), or that other processes write, are not tracked until the next
    construction. Redis never tells us what it evicts, so `on_evict` is never
    called; such records read as misses. While the breaker is open every call
    raises `StoreUnavailable` at once.
    """

    def __init__(
        self,
        config: RedisTierConfig,
        connection: RedisConnection | None = None,
        on_evict: EvictionCallback | None = None,
        name: str = "redis",
    ) -> None:
        self.name = name
        self._config = config
        self._owns_connection = connection is None
        self.connection = connection if connection is not None else RedisConnection(config, name)
        self._prefix = config.key_prefix.encode()
        self._counters = TierCounters()
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._used_nbytes = self._measure_used_bytes()
        except StoreUnavailable:
            self._used_nbytes = 0  # degraded at start; counted from here on

    def put(self, key: bytes, value: bytes | memoryview | SealedRecord) -> None:
        record = bytes(as_record(value, self._config.compress))  # kept past this call
        ttl_ms = None if self._config.ttl_s is None else max(1, int(self._config.ttl_s * 1000))
        name = self._full(key)

        def write(client: Client) -> Any:
            pipe = client.pipeline(transaction=False)  # one key, one slot: one node
            pipe.strlen(name)
            pipe.set(name, record, px=ttl_ms)
            return pipe.execute()

        old_nbytes, _ = self.connection.call("put", write)
        self._adjust_used(len(record) - int(old_nbytes))
        self._counters.add(puts=1, bytes_in=len(value))

    def get(self, key: bytes) -> bytes | memoryview | None:
        raw = self.connection.call("get", lambda client: client.get(self._full(key)))
        if raw is None:
            self._counters.add(misses=1)
            return None
        try:
            body = open_record(reply_bytes(raw))
        except CorruptPayload as exc:
            self._discard_corrupt(key, exc)
            self._counters.add(misses=1)
            return None
        self._counters.add(hits=1, bytes_out=len(body))
        return body

    def get_prefix(self, key: bytes, max_nbytes: int) -> bytes | None:
        name = self._full(key)
        raw = cast(
            "bytes | None",
            self.connection.call(
                "get_prefix", lambda c: c.getrange(name, 0, HEADER_NBYTES + max_nbytes - 1)
            ),
        )
        try:
            if raw and read_header(raw).compressed:
                # a zstd prefix needs only the frame's start, but GETRANGE cannot size it
                raw = cast("bytes | None", self.connection.call("get", lambda c: c.get(name)))
            return body_prefix(raw, max_nbytes) if raw else None
        except CorruptPayload as exc:
            self._discard_corrupt(key, exc)
            return None

    def delete(self, key: bytes) -> bool:
        name = self._full(key)

        def remove(client: Client) -> Any:
            pipe = client.pipeline(transaction=False)
            pipe.strlen(name)
            pipe.delete(name)
            return pipe.execute()

        old_nbytes, num_deleted = self.connection.call("delete", remove)
        self._adjust_used(-int(old_nbytes))
        return bool(num_deleted)

    def contains(self, key: bytes) -> bool:
        return bool(self.connection.call("contains", lambda c: c.exists(self._full(key))))

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        found = self._scan()
        # SCAN may return a key twice (rehashing); dedupe while stripping prefix and tag.
        stripped = (name[len(self._prefix) + TAG_NBYTES :] for name in found)
        return iter(dict.fromkeys(key for key in stripped if key.startswith(prefix)))

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
        if self._owns_connection:
            self.connection.close()

    def stats(self) -> TierStats:
        return self._counters.snapshot()

    def _full(self, key: bytes) -> bytes:
        return hash_tagged(self._prefix, key, key)

    def _scan(self) -> list[bytes]:
        """Every record name under the prefix (all primaries of a Cluster)."""
        pattern = escape_glob(self._prefix) + b"{*"
        return self.connection.call(
            "scan", lambda c: list(c.scan_iter(match=pattern, count=_SCAN_COUNT))
        )

    def _measure_used_bytes(self) -> int:
        names = list(dict.fromkeys(self._scan()))
        if not names:
            return 0

        def measure(client: Client) -> Any:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.strlen(name)
            return pipe.execute()

        return sum(int(n) for n in self.connection.call("scan", measure))

    def _adjust_used(self, delta: int) -> None:
        with self._lock:
            self._used_nbytes = max(0, self._used_nbytes + delta)

    def _discard_corrupt(self, key: bytes, exc: CorruptPayload) -> None:
        # NOTE: an unconditional DEL may drop a record another process wrote in the
        # meantime; that costs one miss, never a wrong read.
        self.delete(key)
        self._counters.add(checksum_failures=1)
        logger.warning("%s: dropped corrupt record %s: %s", self.name, key.hex(), exc)
