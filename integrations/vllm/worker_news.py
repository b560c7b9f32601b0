"""What the worker half tells the scheduler half (`WorkerNews`), and the blocks its faults taint.

Load faults and put outcomes arrive from the engine's thread, the async loader and the
putter, so one lock guards them. A block a load could not write is tainted until the
scheduler has heard of that fault (its count reached `num_faults_seen`): no chunk computed
over it is saved meanwhile. Knows the records, not caches or the sidecar.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvsplice.integrations.vllm.transfer_specs import LoadFaultNews, SaveSpec, WorkerNews


class WorkerNewsDesk:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._news = WorkerNews()
        self._num_faults = 0
        self._tainted: dict[int, int] = {}  # block id -> the fault (count) that tainted it
        self.num_stored_chunks = 0  # acknowledged by the sidecar
        self.num_failed_saves = 0

    def load_failed(self, fault: LoadFaultNews, block_ids: Iterable[int]) -> None:
        """A load failed at `fault.position`; `block_ids` were not written."""
        with self._lock:
            self._num_faults += 1
            for block_id in block_ids:
                self._tainted[block_id] = self._num_faults
            self._news.faults.append(fault)

    def put_outcome(self, spec: SaveSpec, stored: bool) -> None:
        """The chunk was stored (acknowledged), or not (failed, dropped or withheld)."""
        with self._lock:
            if stored:
                self.num_stored_chunks += 1
            else:
                self.num_failed_saves += 1
            (self._news.acked if stored else self._news.failed).append((spec.namespace, spec.key))

    def computed_over_a_fault(self, spec: SaveSpec, num_faults_seen: int) -> bool:
        """Whether the chunk's K/V attended to a block a fault the scheduler had not heard of
        when it planned the save left unwritten."""
        if not self._tainted:
            return False
        with self._lock:
            return any(self._tainted.get(b, 0) > num_faults_seen for b in spec.context_block_ids)

    def take(self, num_faults_seen: int) -> WorkerNews:
        """What happened since the last call; forgets taints the scheduler has heard of."""
        with self._lock:
            if self._tainted:
                self._tainted = {b: f for b, f in self._tainted.items() if f > num_faults_seen}
            news, self._news = self._news, WorkerNews()
        return news
