"""The shared tier behind a sidecar's local tiers: records and events on Redis/Valkey (Cluster).

Owns publishing (a background thread, so no put ever waits on Redis), the rule for
what is written while the tier is degraded, and polling other sidecars' events.
What a record or event means to the store (catalog, indexes) is `tiered_store`'s.

Republish-or-drop rule: a write (put, blob, removal) is queued by key, the latest
operation per key winning. While the tier is degraded the queue waits; when the
tier returns it is published in order. The queue holds at most
`max_pending_publish` keys: past that the oldest is dropped from sharing (counted
in `num_unshared`, logged), and so is the whole queue when the sidecar stops. A
segment dropped from sharing stays in its writer's local tiers, served by it alone.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvsplice.common.errors import StoreUnavailable
from kvsplice.storage.config import RedisTierConfig
from kvsplice.storage.redis_tier import RedisTier
from kvsplice.storage.segment_codec import meta_span, read_meta
from kvsplice.storage.segment_events import READ_COUNT, START_ID, EventStreams, SharedEvent
from kvsplice.storage.segment_lengths import SegmentLengths
from kvsplice.storage.tier import TierStats

logger = logging.getLogger(__name__)

Body = bytes | memoryview
ReadLocal = Callable[[bytes], Body | None]
_DISCOVERY_INTERVAL_S = 1.0
_IDLE_WAIT_S = 0.2


@dataclass(frozen=True)
class SharedStatus:
    """What `/readyz` and the gauges show about the shared tier."""

    degraded: bool
    since_s: float
    last_error: str
    num_trips: int
    num_pending: int  # writes not yet shared (waiting, or the tier is degraded)
    num_unshared: int  # writes dropped from sharing by the rule above
    cluster: bool
    caught_up: bool  # every stream's history was read to its end at least once


@dataclass(frozen=True)
class Polled:
    """What one `poll` read: other sidecars' events, and whether it reached the end of
    every stream without a fault (False: degraded, or a call failed part-way)."""

    events: list[SharedEvent]
    at_end: bool


class SharedTier:
    """Records (`RedisTier`) plus per-namespace event streams; `origin` names this sidecar."""

    def __init__(self, config: RedisTierConfig, name: str = "redis") -> None:
        self.name = name
        self.config = config
        self.origin = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.records = RedisTier(config, name=name)
        self.connection = self.records.connection
        self._events = EventStreams(self.connection, config.key_prefix, config.stream_max_len)
        self.lengths = SegmentLengths(self.connection, config.key_prefix)
        self._read_local: ReadLocal = lambda key: None
        self._pending: OrderedDict[bytes, tuple[str, str]] = OrderedDict()
        self._cond = threading.Condition()
        self._in_flight = 0
        self._publishing: bytes | None = None  # the key the publisher writes now
        self._num_unshared = 0
        self._cursors: dict[str, bytes] = {}
        self._caught_up = False
        self._discovered_at_s = 0.0
        self._shutdown = False
        self.connection.breaker.add_recovery_callback(self._wake)
        self._publisher = threading.Thread(
            target=self._publish_forever, name=f"{name}-publisher", daemon=True
        )
        self._publisher.start()

    def bind(self, read_local: ReadLocal) -> None:
        """Where the publisher reads the bodies it shares (the store's local tiers)."""
        self._read_local = read_local

    # -- writes: queued, published by the background thread ------------------------

    def publish_put(self, key: bytes) -> None:
        self._enqueue(key, "put", "")

    def publish_blob(self, key: bytes) -> None:
        self._enqueue(key, "blob", "")

    def publish_removal(self, key: bytes, reason: str) -> None:
        self._enqueue(key, "remove", reason)

    def is_pending(self, key: bytes) -> bool:
        """True while a write of `key` waits to be published (its body must stay local)."""
        with self._cond:
            return key in self._pending or key == self._publishing

    def wait_published(self, timeout_s: float) -> bool:
        """Block until every queued write is published; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, _IDLE_WAIT_S))
        return True

    # -- reads ------------------------------------------------------------------------

    def get(self, key: bytes) -> Body | None:
        """The shared record, None if absent; `StoreUnavailable` while degraded."""
        return self.records.get(key)

    def poll(self) -> Polled:
        """Other sidecars' events since the last poll, every namespace (none while degraded).

        The first polls replay each stream from its start (streams are trimmed to about
        `stream_max_len` events): the history is read once a poll ends `at_end`. What was
        read before a fault is returned (the cursors moved past it). Call from one thread
        at a time.
        """
        events: list[SharedEvent] = []
        try:
            self._discover()
            for namespace in list(self._cursors):
                # past batches of our own events too
                while len(events) < READ_COUNT:
                    batch, cursor, num_read = self._events.read(namespace, self._cursors[namespace])
                    self._cursors[namespace] = cursor
                    events.extend(event for event in batch if event.origin != self.origin)
                    if num_read < READ_COUNT:
                        break
                else:
                    return Polled(events, at_end=False)  # a full batch: more may follow
        except StoreUnavailable as exc:
            logger.debug("%s: polling stopped while degraded: %s", self.name, exc)
            return Polled(events, at_end=False)
        self._caught_up = True
        return Polled(events, at_end=True)

    @property
    def ever_connected(self) -> bool:
        """False while the tier has been unreachable since start (issue 15: serve degraded)."""
        return self.connection.is_connected

    # -- state ------------------------------------------------------------------------

    def status(self) -> SharedStatus:
        breaker = self.connection.breaker.state
        with self._cond:
            num_pending = len(self._pending) + self._in_flight
            num_unshared = self._num_unshared
        return SharedStatus(
            degraded=breaker.is_open,
            since_s=breaker.since_s,
            last_error=breaker.last_error,
            num_trips=breaker.num_trips,
            num_pending=num_pending,
            num_unshared=num_unshared,
            cluster=self.config.cluster,
            caught_up=self._caught_up,
        )

    def stats(self) -> TierStats:
        return self.records.stats()

    def used_bytes(self) -> int:
        return self.records.used_bytes()

    def capacity_bytes(self) -> int | None:
        return self.records.capacity_bytes()

    def close(self) -> None:
        with self._cond:
            self._shutdown = True
            if self._pending:
                logger.warning(
                    "%s: %d writes left unshared at close", self.name, len(self._pending)
                )
            self._cond.notify_all()
        self._publisher.join(timeout=2 * self.config.socket_timeout_s + 1)
        self.records.close()

    # -- internals ------------------------------------------------------------------

    def _discover(self) -> None:
        now_s = time.monotonic()
        if self._cursors and now_s - self._discovered_at_s < _DISCOVERY_INTERVAL_S:
            return
        for namespace in self._events.namespaces():
            self._cursors.setdefault(namespace, START_ID)
        self._discovered_at_s = now_s

    def _enqueue(self, key: bytes, op: str, reason: str) -> None:
        with self._cond:
            self._pending.pop(key, None)
            self._pending[key] = (op, reason)
            if len(self._pending) > self.config.max_pending_publish:
                dropped, _ = self._pending.popitem(last=False)
                self._num_unshared += 1
                logger.warning("%s: write of %s dropped from sharing", self.name, dropped.hex())
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _next(self) -> tuple[bytes, tuple[str, str]] | None:
        """The oldest queued write once the tier is up; None at shutdown."""
        with self._cond:
            while not self._shutdown and (not self._pending or self.connection.breaker.is_open):
                self._cond.wait(_IDLE_WAIT_S)
            if self._shutdown:
                return None
            self._in_flight += 1
            item = self._pending.popitem(last=False)
            self._publishing = item[0]
            return item

    def _publish_forever(self) -> None:
        while (item := self._next()) is not None:
            key, (op, reason) = item
            try:
                self._publish(key, op, reason)
            except StoreUnavailable:
                with self._cond:  # back to the front, unless a newer write replaced it
                    if key not in self._pending:
                        self._pending[key] = (op, reason)
                        self._pending.move_to_end(key, last=False)
            except Exception:  # a bug must not stop sharing for every later write
                logger.exception("%s: publishing %s %s failed", self.name, op, key.hex())
                with self._cond:
                    self._num_unshared += 1
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._publishing = None
                    self._cond.notify_all()

    def _publish(self, key: bytes, op: str, reason: str) -> None:
        if op == "remove":
            self.records.delete(key)
            self._events.publish(SharedEvent("remove", key, self.origin, reason=reason))
            return
        body = self._read_local(key)
        if body is None:
            return  # removed meanwhile; that removal is queued behind this write
        self.records.put(key, body)
        head = bytes(body[: meta_span(body)]) if op == "put" else b""
        if head:  # before the event: whoever learns of the put can probe its length
            meta = read_meta(head)
            self.lengths.record(meta.namespace, meta.num_tokens)
        self._events.publish(SharedEvent(op, key, self.origin, head=head))
