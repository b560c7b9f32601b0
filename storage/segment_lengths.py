"""The segment lengths each namespace's writers use, kept in the shared tier: one hash per
namespace, length -> number of puts published with it.

A sidecar whose index holds nothing of a namespace (started after its events were trimmed,
or while its catch-up failed) still knows which lengths to try when a lookup walks a
prompt's chain through the cluster (`server.shared_prefix`). Owns the hash's name, its
updates and a short-lived cache of its reads; what is probed is the caller's.
"""

from __future__ import annotations

import threading
import time

from kvsplice.storage.redis_connection import RedisConnection, hash_tagged, reply_bytes

CACHE_S = 1.0  # how long a namespace's lengths are reused before they are read again


class SegmentLengths:
    """Per-namespace counts of published segment lengths under `key_prefix`."""

    def __init__(self, connection: RedisConnection, key_prefix: str) -> None:
        self._connection = connection
        self._prefix = key_prefix.encode() + b"lengths:"
        self._lock = threading.Lock()  # guards _cached (lookups read from worker threads)
        self._cached: dict[str, tuple[float, tuple[int, ...]]] = {}

    def hash_name(self, namespace: str) -> bytes:
        encoded = namespace.encode()
        return hash_tagged(self._prefix, encoded, encoded)

    def record(self, namespace: str, num_tokens: int) -> None:
        """Count one published put of a `num_tokens`-token segment (`StoreUnavailable`)."""
        name = self.hash_name(namespace)
        self._connection.call("hincrby", lambda c: c.hincrby(name, str(num_tokens), 1))

    def commonest(self, namespace: str, most: int) -> tuple[int, ...]:
        """At most `most` lengths of `namespace`, the most used first (ties: shorter first);
        read again at most every `CACHE_S` (`StoreUnavailable` while degraded)."""
        now_s = time.monotonic()
        with self._lock:
            cached = self._cached.get(namespace)
        if cached is None or now_s - cached[0] > CACHE_S:
            cached = (now_s, self._read(namespace))
            with self._lock:
                self._cached[namespace] = cached
        return cached[1][:most]

    def _read(self, namespace: str) -> tuple[int, ...]:
        name = self.hash_name(namespace)
        counts = self._connection.call("hgetall", lambda c: c.hgetall(name))
        parsed = []
        for length, count in counts.items():
            try:
                parsed.append((-int(reply_bytes(count)), int(reply_bytes(length))))
            except ValueError:  # defensive: the hash is shared; a stray field is skipped
                continue
        return tuple(length for _, length in sorted(parsed) if length > 0)
