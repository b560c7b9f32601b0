"""What sidecars tell each other through the shared tier: one Redis Stream per namespace.

An event says a record was written (`put`, carrying the segment's meta section so a
reader can catalog and index it without the payload), removed (`remove`, with the
reason) or a blob changed (`blob`). A set lists the namespaces that have a stream.
Owns the stream names, the event encoding, publishing and reading from cursors;
applying events to a store is `tiered_store`'s job.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from redis.typing import EncodableT, FieldT

from kvsplice.storage.keyspace import BLOB_SPACE, SEGMENT_SPACE
from kvsplice.storage.redis_connection import RedisConnection, hash_tagged, reply_bytes

logger = logging.getLogger(__name__)

EVENT_OPS = ("put", "remove", "blob")
READ_COUNT = 1000
START_ID = b"0-0"


@dataclass(frozen=True)
class SharedEvent:
    """One change to the shared tier; `head` is a segment body's meta section (put only)."""

    op: str
    key: bytes
    origin: str
    head: bytes = b""
    reason: str = ""

    def __post_init__(self) -> None:
        if self.op not in EVENT_OPS:
            raise ValueError(f"op {self.op!r} is not one of {EVENT_OPS}")

    @property
    def namespace(self) -> str:
        """The namespace scoping `key` (see `keyspace`)."""
        return namespace_of(self.key)

    def fields(self) -> dict[bytes, bytes]:
        return {
            b"op": self.op.encode(),
            b"key": self.key,
            b"origin": self.origin.encode(),
            b"head": self.head,
            b"reason": self.reason.encode(),
        }

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> SharedEvent:
        return cls(
            op=fields[b"op"].decode(),
            key=fields[b"key"],
            origin=fields[b"origin"].decode(),
            head=fields.get(b"head", b""),
            reason=fields.get(b"reason", b"").decode(),
        )


def namespace_of(key: bytes) -> str:
    """The namespace of a segment or blob tier key."""
    if not key.startswith((SEGMENT_SPACE, BLOB_SPACE)):
        raise ValueError(f"key {key[:16]!r} is neither a segment nor a blob key")
    return key[2:].split(b"\x00", 1)[0].decode()


class EventStreams:
    """Publish to and read from the per-namespace streams under `key_prefix`."""

    def __init__(self, connection: RedisConnection, key_prefix: str, max_len: int) -> None:
        self._connection = connection
        self._prefix = key_prefix.encode()
        self._max_len = max_len
        self._registry = self._prefix + b"namespaces"
        self._registered: set[str] = set()

    def stream_name(self, namespace: str) -> bytes:
        encoded = namespace.encode()
        return hash_tagged(self._prefix + b"events:", encoded, encoded)

    def publish(self, event: SharedEvent) -> None:
        """Append `event` to its namespace's stream (trimmed to about `max_len` events)."""
        namespace = event.namespace
        if namespace not in self._registered:
            self._connection.call("sadd", lambda c: c.sadd(self._registry, namespace))
            self._registered.add(namespace)
        stream = self.stream_name(namespace)
        # redis-py types fields as a dict of its wider key/value unions (dict is invariant)
        fields: dict[FieldT, EncodableT] = {k: v for k, v in event.fields().items()}
        self._connection.call(
            "xadd", lambda c: c.xadd(stream, fields, maxlen=self._max_len, approximate=True)
        )

    def namespaces(self) -> list[str]:
        members = self._connection.call("smembers", lambda c: c.smembers(self._registry))
        return sorted(reply_bytes(m).decode() for m in members)

    def read(self, namespace: str, after_id: bytes) -> tuple[list[SharedEvent], bytes, int]:
        """Events of `namespace` after `after_id` (at most `READ_COUNT`), the new cursor and
        how many entries were read (malformed ones included)."""
        stream = self.stream_name(namespace)
        replies = self._connection.call(
            "xread", lambda c: c.xread({stream: after_id}, count=READ_COUNT)
        )
        events, cursor, num_read = [], after_id, 0
        for _, entries in _stream_entries(replies):
            for entry_id, fields in entries:
                cursor, num_read = entry_id, num_read + 1
                try:
                    events.append(SharedEvent.from_fields(fields))
                except (KeyError, ValueError, UnicodeDecodeError) as exc:
                    logger.warning("skipped malformed event %s on %r: %s", entry_id, namespace, exc)
        return events, cursor, num_read

    def last_id(self, namespace: str) -> bytes:
        """The id of the newest event of `namespace` now (START_ID when none)."""
        stream = self.stream_name(namespace)
        newest = self._connection.call("xrevrange", lambda c: c.xrevrange(stream, count=1))
        return reply_bytes(newest[0][0]) if newest else START_ID


def _stream_entries(replies: Any) -> Iterable[tuple[bytes, list[tuple[bytes, dict]]]]:
    """XREAD's reply as (stream, entries) pairs (RESP2 lists and RESP3 maps alike)."""
    if isinstance(replies, dict):
        return replies.items()
    return [(stream, entries) for stream, entries in replies or ()]
