"""Sending reuse reports: merged as calls end, sent by one background thread.

A call never waits on the network: `ReuseReporter.add` merges under a lock and
returns; the thread sends what accumulated, in one RPC, every `interval_s`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvsplice.common.reuse_report import ReuseReport

logger = logging.getLogger(__name__)

# send(report) -> False when the store could not be reached (keep it for the next flush).
SendFn = Callable[[ReuseReport], bool]


class ReuseReporter:
    """Reports merged until the next flush; the flush thread starts with the first report.

    `add` merges under a lock and returns; every `interval_s` the thread sends what
    accumulated, in one RPC. A report the store could not take (unreachable) is merged
    back and sent with the next; one it refused is dropped and counted by the sender.
    """

    def __init__(self, send: SendFn, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s {interval_s} must be > 0")
        self.interval_s = interval_s
        self._send = send
        self._lock = threading.Lock()  # guards _pending and _thread
        self._sending = threading.Lock()  # one flush at a time, in report order
        self._pending = ReuseReport()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, report: ReuseReport) -> None:
        """Merge `report` into the next flush (never blocks on I/O)."""
        if report.empty:
            return
        with self._lock:
            self._pending = self._pending.merged(report)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="kvsplice-reuse-reports", daemon=True
                )
                self._thread.start()

    def flush(self) -> bool:
        """Send what is pending now; False if the store could not take it (kept)."""
        with self._sending:
            with self._lock:
                report, self._pending = self._pending, ReuseReport()
            if report.empty or self._send(report):
                return True
            with self._lock:
                self._pending = report.merged(self._pending)
            return False

    def close(self) -> None:
        """Stop the thread and send what is pending (one attempt)."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception:  # a bug must not end reporting silently; the next flush retries
                logger.exception("reuse report failed")
