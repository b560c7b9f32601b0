"""The shape of a background putter: a bounded queue drained in order by one daemon thread.

The HF worker's `SegmentWriter` and the vLLM connector's `ChunkPutter` put through one.
`offer` never blocks (False when full: the owner drops and counts), `put` blocks
(back-pressure); `flush` waits until every item so far was handled, `close` handles
what is queued and stops the thread. What an item is and what putting it means is the
owner's `handle`, which must not raise (the thread serves every later item).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
_STOP = object()
_POLL_S = 0.005


class PutQueue(Generic[T]):
    """Hands each item to `handle` on one daemon thread named `name`, in order."""

    def __init__(self, handle: Callable[[T], None], max_pending: int, name: str) -> None:
        self._handle = handle
        self._queue: queue.Queue[object] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """False once closed."""
        return self._thread.is_alive()

    def put(self, item: T) -> None:
        """Queue `item`, waiting while the queue is full."""
        self._queue.put(item)

    def offer(self, item: T) -> bool:
        """Queue `item` if there is room; False (not queued) when full."""
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            return False
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every item queued so far was handled; False if `timeout_s` passed first."""
        if timeout_s is None:
            self._queue.join()
            return True
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return not self._queue.unfinished_tasks

    def close(self, timeout_s: float | None = None) -> None:
        """Handle what is queued, then stop the thread; with `timeout_s`, wait at most about
        that long for each (a thread still busy after it is left to finish as a daemon)."""
        if not self._thread.is_alive():
            return
        if timeout_s is None:
            self._queue.put(_STOP)
            self._thread.join()
            return
        self.flush(timeout_s)
        try:
            self._queue.put(_STOP, timeout=1.0)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._handle(item)  # type: ignore[arg-type]
            finally:
                self._queue.task_done()
