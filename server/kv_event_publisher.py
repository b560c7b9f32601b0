"""The sidecar's KV event stream: a ZMQ PUB socket (and a ROUTER for replays) in vLLM's wire
format, fed with the index's changes (`indexed`, `unindexed`) from any thread.

One thread owns the sockets and the `KvEventLog`: it batches the changes of up to
`batch_interval_s`, publishes them as one `KVEventBatch`, and answers replay requests as
vLLM's `ZmqEventPublisher` does (8-byte big-endian start sequence in, the batches since
then out, an empty end frame). The endpoints are always bound (an operator's, admin-only).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import MISSING, dataclass

import zmq

from kvsplice.common.config_flags import flag
from kvsplice.common.errors import ServeRefused
from kvsplice.common.segment import SegmentMeta
from kvsplice.server.kv_event_log import Change, Cleared, KvEventLog
from kvsplice.server.kv_event_wire import END_SEQ, HASH_FORMATS, encode_batch, frames

logger = logging.getLogger(__name__)
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KvEventsConfig:
    """Where the stream is bound; `block_hashes` must match the engines'
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES ("int", vLLM's default, or "bytes")."""

    endpoint: str = flag(
        MISSING, "Publish KV events (vLLM's ZMQ format) on this bound address, tcp://HOST:PORT.",
        name="kv-events-endpoint", cli_default=None, switch=True,
    )  # fmt: skip
    replay_endpoint: str | None = flag(
        None, "Answer KV event replay requests (ZMQ ROUTER) on this bound address.",
        name="kv-events-replay-endpoint",
    )  # fmt: skip
    topic: str | None = flag(
        None, "Topic of the published KV event frames (none: empty).", name="kv-events-topic"
    )
    block_hashes: str = flag(
        "int", "Block hashes as vLLM publishes them: int (its default) or bytes.",
        name="kv-events-block-hashes", choices=HASH_FORMATS,
    )  # fmt: skip
    buffer_steps: int = 10_000  # batches kept for replay
    batch_interval_s: float = 0.05
    hwm: int = 100_000

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (value.startswith(_SCHEMES) and value.split("://")[1]):
                raise ValueError(f"{name} {value!r} must be tcp://HOST:PORT, ipc:// or inproc://")
        if self.block_hashes not in HASH_FORMATS:
            raise ValueError(f"block_hashes {self.block_hashes!r} not in {HASH_FORMATS}")
        if self.buffer_steps <= 0 or self.hwm <= 0 or not 0 < self.batch_interval_s <= 1:
            raise ValueError(
                f"buffer_steps {self.buffer_steps} and hwm {self.hwm} must be > 0, "
                f"batch_interval_s {self.batch_interval_s} in (0, 1]"
            )


class KvEventPublisher:
    """Started on construction (the index's first change is `Cleared`); `close` stops it."""

    def __init__(self, config: KvEventsConfig) -> None:
        self.config = config
        self._log = KvEventLog(config.block_hashes, config.buffer_steps)
        self._changes: queue.SimpleQueue[Change | None] = queue.SimpleQueue()
        self._topic = (config.topic or "").encode()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._bound(zmq.PUB, config.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            try:
                self._replay = self._bound(zmq.ROUTER, config.replay_endpoint)
            except BaseException:
                self._pub.close(linger=0)
                raise
        self.endpoint = _last_endpoint(self._pub)
        self.replay_endpoint = None if self._replay is None else _last_endpoint(self._replay)
        self._changes.put(Cleared.CLEARED)
        self._alive = True
        self._thread = threading.Thread(target=self._run, name="kvsplice-kv-events", daemon=True)
        self._thread.start()

    def indexed(self, meta: SegmentMeta) -> None:
        if self._alive:  # a stream that stopped takes nothing more (nobody would drain it)
            self._changes.put(meta)

    def unindexed(self, namespace: str, context_key: bytes) -> None:
        if self._alive:
            self._changes.put((namespace, context_key))

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is queued, then close the sockets."""
        self._changes.put(None)
        self._thread.join(timeout_s)

    def _bound(self, kind: int, endpoint: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.set_hwm(self.config.hwm)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as error:
            sock.close(linger=0)
            raise ServeRefused(f"cannot bind KV events on {endpoint}: {error}") from error
        return sock

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except Exception:  # a broken stream must not take the store down; say so once
            logger.exception("the KV event stream stopped")
        finally:
            self._alive = False
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _step(self) -> bool:
        """Serve replays, then publish the changes of one interval; False once closed."""
        while self._replay is not None and self._replay.poll(0):
            self._serve_replay()
        changes, open_ = _drain(self._changes, self.config.batch_interval_s)
        events = self._log.events(changes)
        if events:
            payload = encode_batch(time.time(), events)
            self._pub.send_multipart(frames(self._topic, self._log.published(payload), payload))
        return open_

    def _serve_replay(self) -> None:
        assert self._replay is not None
        request = self._replay.recv_multipart()
        if len(request) != 3 or len(request[2]) != 8:
            logger.warning("ignored a malformed KV event replay request (%d frames)", len(request))
            return
        client_id, _, start = request
        for seq, payload in self._log.replay(int.from_bytes(start, "big"), time.time()):
            self._replay.send_multipart((client_id, b"", *frames(self._topic, seq, payload)))
        self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))


def _drain(changes: queue.SimpleQueue[Change | None], wait_s: float) -> tuple[list[Change], bool]:
    """What arrives within `wait_s` of the first change (or nothing after `wait_s`), and
    whether the publisher stays open."""
    taken: list[Change] = []
    deadline = time.monotonic() + wait_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            change = changes.get(timeout=left)
        except queue.Empty:
            break
        if change is None:
            return taken, False
        taken.append(change)
    return taken, True


def _last_endpoint(sock: zmq.Socket) -> str:
    """The bound address (a tcp port of 0 resolved)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
