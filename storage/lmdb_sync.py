"""The LMDB tier's fsync window: commits land unsynced and are fsynced together, at
most `interval_s` after the first of them, or before a put is acknowledged once more
than `max_unsynced_bytes` wait. Owns the syncer thread and the count of what waits;
what a sync is (`env.sync`) belongs to the tier.

What it bounds: an OS crash or power loss loses at most the puts committed in the last
`interval_s` plus one sync's duration, and never more than `max_unsynced_bytes` of them.
A crash of the process alone (SIGKILL, OOM) loses nothing committed: the kernel holds it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvsplice.common.errors import StoreUnavailable

logger = logging.getLogger(__name__)


class SyncWindow:
    """Counts committed-but-unsynced bytes and fsyncs them in groups."""

    def __init__(
        self, sync: Callable[[], None], interval_s: float, max_unsynced_bytes: int, name: str
    ) -> None:
        if interval_s <= 0 or max_unsynced_bytes < 1:
            raise ValueError(f"interval_s {interval_s} and max_unsynced_bytes must be > 0")
        self._sync = sync
        self._interval_s = interval_s
        self._max_unsynced_bytes = max_unsynced_bytes
        self._lock = threading.Lock()
        self._pending = threading.Condition(self._lock)
        self._sync_lock = threading.Lock()  # one sync at a time
        self._unsynced_nbytes = 0  # committed, not yet known synced (a sync's included)
        self._waiting_nbytes = 0  # committed, no sync started on them yet
        self._num_syncs = 0
        self._error: BaseException | None = None
        self._closed = False
        self._closing = threading.Event()  # wakes the syncer out of its interval
        self._thread = threading.Thread(target=self._run, name=f"{name}-sync", daemon=True)
        self._thread.start()

    @property
    def num_syncs(self) -> int:
        return self._num_syncs

    @property
    def unsynced_nbytes(self) -> int:
        with self._lock:
            return self._unsynced_nbytes

    def committed(self, nbytes: int) -> None:
        """Count a commit of `nbytes`; fsync first if the window would hold too much."""
        with self._lock:
            self._raise_error()
            self._unsynced_nbytes += nbytes
            self._waiting_nbytes += nbytes
            over = self._unsynced_nbytes > self._max_unsynced_bytes
            self._pending.notify()
        if over:
            self.flush()

    def flush(self) -> None:
        """fsync every commit counted so far (waits for a sync already under way)."""
        with self._sync_lock:
            with self._lock:
                nbytes, self._waiting_nbytes = self._waiting_nbytes, 0
            if nbytes:
                try:
                    self._sync()
                except BaseException:
                    with self._lock:  # still unsynced: the next flush tries them again
                        self._waiting_nbytes += nbytes
                    raise
                with self._lock:
                    self._unsynced_nbytes -= nbytes
                    self._num_syncs += 1

    def close(self) -> None:
        """Stop the syncer and fsync what is left; idempotent."""
        with self._lock:
            self._closed = True
            self._pending.notify()
        self._closing.set()
        self._thread.join()
        self.flush()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._waiting_nbytes and not self._closed:
                    self._pending.wait()
                if self._closed:
                    return
            self._closing.wait(self._interval_s)  # gather the window's commits
            try:
                self.flush()
            except Exception as error:
                logger.error("fsync of the LMDB tier failed: %s", error)
                with self._lock:
                    self._error = error

    def _raise_error(self) -> None:
        if self._error is not None:
            raise StoreUnavailable(f"the LMDB tier could not fsync: {self._error}") from self._error
