"""A test's scheduler with kvsplice's worker half behind it: what vLLM hears of a load is kvsplice's.

vLLM's tests script a failure as `invalid_block_ids` (or `failed_recving`) in the model
runner output they hand `update_from_output`. Here that script becomes a kvsplice fault
(`LoadFaults`) on the scripted block's piece before the step's loads run; the worker half
then runs the step (`WorkerBehind`) and its own output replaces the scripted one. Where
kvsplice's answer differs from the script, `disagreements` says so (checked after the
test's own assertions ran). `guard` fails when a test put a connector of its own in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from load_faults import LoadFaults
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from worker_steps import WorkerBehind

from kvsplice.integrations.vllm import KvspliceConnector
from kvsplice.integrations.vllm.transfer_specs import LoadSpec, SaveSpec


class KvspliceBehind:
    def __init__(
        self, scheduler: Scheduler, worker: WorkerBehind, faults: LoadFaults | None,
        is_stand_in: Callable[[Any], bool],
    ) -> None:  # fmt: skip
        assert isinstance(scheduler.connector, KvspliceConnector), scheduler.connector
        self.scheduler = scheduler
        self.kvsplice: KvspliceConnector = scheduler.connector
        self.worker = worker
        self.faults = faults
        self.is_stand_in = is_stand_in
        self.disagreements: list[str] = []
        self.loads: dict[str, LoadSpec] = {}  # request id -> its load (last seen)
        self.scripted_at: dict[str, int] = {}  # request id -> first block the script failed
        self.reported_at: dict[str, int] = {}  # request id -> first block kvsplice failed
        self.failed_step_saves: list[SaveSpec] = []  # saves planned in a step whose load failed
        self.finished: set[str] = set()
        self.num_steps = 0
        self._ran: set[int] = set()  # scheduler outputs the worker ran
        self._update = scheduler.update_from_output
        self._schedule = scheduler.schedule
        scheduler.update_from_output = self.update_from_output  # type: ignore[method-assign]
        scheduler.schedule = self.schedule  # type: ignore[method-assign]

    def guard(self) -> None:
        connector = self.scheduler.connector
        assert connector is self.kvsplice or self.is_stand_in(connector), (
            f"the test put {connector!r} in as the scheduler's connector: "
            "not kvsplice's, nor the stand-in over it"
        )

    def schedule(self) -> SchedulerOutput:
        self.guard()
        return self._schedule()

    def update_from_output(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput
    ) -> Any:
        self.guard()
        scripted = output.kv_connector_output or KVConnectorOutput()
        if id(scheduler_output) in self._ran:  # the test hands a step in again: a later step
            ours = self.worker.idle_step(self._num_faults_seen())
            saves: list[SaveSpec] = []
        else:
            self._ran.add(id(scheduler_output))
            meta = scheduler_output.kv_connector_metadata
            self.loads.update((load.request_id, load) for load in getattr(meta, "loads", ()))
            self._inject(scripted, getattr(meta, "loads", ()))
            ours = self.worker.step(scheduler_output)
            saves = list(getattr(meta, "saves", ()))
        self.num_steps += 1
        self._compare(scripted, ours, saves)
        return self._update(scheduler_output, dataclasses.replace(output, kv_connector_output=ours))

    def _num_faults_seen(self) -> int:
        assert self.kvsplice.scheduler is not None
        return self.kvsplice.scheduler.num_faults_seen

    def _scripted_failures(self, scripted: KVConnectorOutput) -> dict[str, int]:
        """request id -> the first of its load's blocks the script fails."""
        failures = {}
        for request_id, load in self.loads.items():
            indexes = [k for k, b in enumerate(load.block_ids) if b in scripted.invalid_block_ids]
            if request_id in scripted.failed_recving:
                indexes.append(0)
            if indexes:
                failures[request_id] = min(indexes)
        known = {b for load in self.loads.values() for b in load.block_ids}
        if scripted.invalid_block_ids - known:
            self.disagreements.append(
                f"the script fails blocks {sorted(scripted.invalid_block_ids - known)} "
                "that kvsplice never loaded"
            )
        return failures

    def _inject(self, scripted: KVConnectorOutput, loads: Any) -> None:
        failures = self._scripted_failures(scripted)
        for load in loads:
            index = failures.get(load.request_id)
            if index is None:
                continue
            assert self.faults is not None, "the test scripts a load failure: name its fault"
            self.faults.inject(load, index, self.worker.side)

    def _compare(
        self, scripted: KVConnectorOutput, ours: KVConnectorOutput, saves: list[SaveSpec]
    ) -> None:
        for request_id, index in self._scripted_failures(scripted).items():
            self.scripted_at[request_id] = min(index, self.scripted_at.get(request_id, index))
        for request_id, load in self.loads.items():
            reported = [k for k, b in enumerate(load.block_ids) if b in ours.invalid_block_ids]
            if not reported:
                continue
            first = min(reported)
            self.reported_at[request_id] = first
            if reported != list(range(first, len(load.block_ids))):
                self.disagreements.append(f"{request_id}: kvsplice failed blocks {reported}")
            failed = set(load.block_ids[first:])
            self.failed_step_saves += [s for s in saves if failed & set(s.context_block_ids)]
        for request_id, index in self.scripted_at.items():
            if self.reported_at.get(request_id) != index:
                self.disagreements.append(
                    f"{request_id}: the script fails its load from block {index}, kvsplice "
                    f"from {self.reported_at.get(request_id)}"
                )
        for request_id in set(self.reported_at) - set(self.scripted_at):
            self.disagreements.append(f"{request_id}: kvsplice failed a load the script did not")
        self.finished |= ours.finished_recving or set()
        if scripted.finished_recving and not scripted.finished_recving <= self.finished:
            self.disagreements.append(
                f"the script finishes {sorted(scripted.finished_recving)}, kvsplice "
                f"{sorted(self.finished)}"
            )
