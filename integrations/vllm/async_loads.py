"""Loads that run beside the engine's steps (vLLM's `load_kv_async`): one background
thread works through them in order; `take_finished` says which requests' loads ended
and which of their blocks could not be written.

Owns only the thread and the hand-over; what a load does is `BlockLoader.load`'s.
NOTE: every submitted load is reported finished exactly once, failed or not: vLLM
keeps an aborted request's blocks until then, so none is written after it is freed.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from kvsplice.integrations.vllm.transfer_specs import LoadSpec

logger = logging.getLogger(__name__)

LoadFn = Callable[[LoadSpec], set[int]]  # the block ids it could not write; never raises


class AsyncLoads:
    def __init__(self, load: LoadFn) -> None:
        self._load = load
        self._queue: queue.Queue[LoadSpec | None] = queue.Queue()
        self._lock = threading.Lock()
        self._finished: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="kvsplice-loader", daemon=True)
        self._thread.start()

    def submit(self, spec: LoadSpec) -> None:
        self._queue.put(spec)

    def take_finished(self) -> tuple[set[str], set[int]]:
        """Request ids whose loads ended since the last call, and the block ids among
        theirs that were not written (vLLM recomputes them)."""
        with self._lock:
            finished, self._finished = self._finished, set()
            failed, self._failed_blocks = self._failed_blocks, set()
        return finished, failed

    def close(self, timeout_s: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            spec = self._queue.get()
            if spec is None:
                return
            try:
                failed = self._load(spec)
            except Exception:  # `load` never raises; if it did, nothing it wrote is trusted
                logger.exception("an async load failed")
                failed = set(spec.block_ids)
            with self._lock:
                self._finished.add(spec.request_id)
                self._failed_blocks |= failed
