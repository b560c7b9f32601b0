"""A worker-role KvspliceConnector behind a test's scheduler, driven as vLLM's model runners drive it.

`WorkerBehind(scheduler, runner)` makes the connector over CPU KV caches shaped as vLLM
builds them and runs a step's connector calls in V1's order (`KVConnectorModelRunnerMixin`:
handle_preemptions, then its `_get_kv_connector_output`) or V2's (`ActiveKVConnector`:
pre_forward with a real `InputBatch`, finish_forward, post_forward), with vLLM's own code
making the calls. Knows vLLM's runners, not the tests or the faults.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from kvsplice.integrations.vllm import KvspliceConnector
from kvsplice.integrations.vllm.connector import KvspliceMetadata

RUNNERS = ("v1", "v2")
ASYNC_LOAD_DEADLINE_S = 20.0


class WorkerBehind:
    def __init__(self, scheduler: Scheduler, runner: str) -> None:
        if runner not in RUNNERS:
            raise ValueError(f"runner {runner!r} is not one of {RUNNERS}")
        self.runner = runner
        self.vllm_config = scheduler.vllm_config
        worker = KVConnectorFactory.create_connector(
            self.vllm_config, KVConnectorRole.WORKER, scheduler.kv_cache_config
        )
        assert isinstance(worker, KvspliceConnector)
        self.connector = worker
        caches = kv_caches_like_vllm(self.vllm_config, scheduler.kv_cache_config.num_blocks)
        self._v2: ActiveKVConnector | None = None
        with self.agent():
            if runner == "v2":  # V2 registers the caches itself, then the copy op
                self._v2 = ActiveKVConnector(self.vllm_config, caches)
            else:
                worker.register_kv_caches(caches)
        self._async_pending: set[str] = set()  # async loads submitted, not reported finished

    @property
    def side(self) -> Any:
        """kvsplice's worker half (`WorkerSide`), once its caches are registered."""
        assert self.connector.worker is not None, self.connector._disabled
        return self.connector.worker

    def agent(self) -> Any:
        """vLLM's process-wide connector (`get_kv_transfer_group`) is this one meanwhile."""
        return _Agent(self.connector)

    def step(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        """The step's connector calls as the runner makes them; async loads it starts are
        waited for (with idle steps, as the engine's next steps would poll them)."""
        meta = scheduler_output.kv_connector_metadata
        assert isinstance(meta, KvspliceMetadata), f"kvsplice's scheduler half made {meta!r}"
        self._async_pending |= {load.request_id for load in meta.loads if load.is_async}
        output = self._one_step(scheduler_output)
        return self._until_async_loads_end(output, meta.num_faults_seen)

    def idle_step(self, num_faults_seen: int) -> KVConnectorOutput:
        """A step that schedules nothing (vLLM still calls the connector: `no_forward`)."""
        idle = _idle_output(num_faults_seen)
        return self._until_async_loads_end(self._one_step(idle), num_faults_seen)

    def shutdown(self) -> None:
        self.connector.shutdown()

    def _one_step(self, scheduler_output: SchedulerOutput) -> KVConnectorOutput:
        with self.agent():
            if self._v2 is not None:
                return _v2_step(self._v2, scheduler_output, self.vllm_config)
            return _v1_step(self.connector, scheduler_output, self.vllm_config)

    def _until_async_loads_end(
        self, output: KVConnectorOutput, num_faults_seen: int
    ) -> KVConnectorOutput:
        deadline = time.monotonic() + ASYNC_LOAD_DEADLINE_S
        while self._async_pending - (output.finished_recving or set()):
            assert time.monotonic() < deadline, f"async loads {self._async_pending} never ended"
            time.sleep(0.002)
            output = merged(output, self._one_step(_idle_output(num_faults_seen)))
        self._async_pending -= output.finished_recving or set()
        return output


class _Agent:
    def __init__(self, connector: KvspliceConnector) -> None:
        self.connector = connector

    def __enter__(self) -> None:
        self.previous = kv_transfer_state._KV_CONNECTOR_AGENT
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector

    def __exit__(self, *exc_info: object) -> None:
        kv_transfer_state._KV_CONNECTOR_AGENT = self.previous


def _v1_step(
    connector: KvspliceConnector, scheduler_output: SchedulerOutput, config: VllmConfig
) -> KVConnectorOutput:
    """GPUModelRunner.execute_model (V1): handle_preemptions, then the forward inside the
    mixin's connector context (bind, start_load_kv before or after it, wait_for_save, ...)."""
    assert scheduler_output.kv_connector_metadata is not None
    connector.handle_preemptions(scheduler_output.kv_connector_metadata)
    with (
        set_forward_context(None, config),
        KVConnectorModelRunnerMixin.maybe_get_kv_connector_output(scheduler_output) as output,
    ):
        pass  # the forward pass: no model runs, the caches keep what was loaded
    assert output is not None
    return output


def _v2_step(
    active: ActiveKVConnector, scheduler_output: SchedulerOutput, config: VllmConfig
) -> KVConnectorOutput:
    """GPUModelRunner.execute_model (V2): pre_forward with the step's InputBatch (no batch:
    `no_forward`), the forward, finish_forward, post_forward."""
    batch = input_batch(scheduler_output)
    if batch is None:  # NOTE: an output with nothing in it comes back as no output
        output = active.no_forward(scheduler_output).kv_connector_output or KVConnectorOutput()
    else:
        active.pre_forward(scheduler_output, batch)
        with set_forward_context(None, config):
            pass  # the forward pass
        active.finish_forward()
        output = active.post_forward(scheduler_output.finished_req_ids)
    assert output is not None
    return output


def input_batch(scheduler_output: SchedulerOutput) -> InputBatch | None:
    """V2's batch for the step's scheduled requests (None: nothing scheduled, no forward)."""
    scheduled = scheduler_output.num_scheduled_tokens
    if not scheduled:
        return None
    num_tokens = sum(scheduled.values())
    buffers = InputBuffers(len(scheduled), num_tokens, torch.device("cpu"))
    batch = InputBatch.make_dummy(len(scheduled), num_tokens, buffers, is_padding=False)
    return dataclasses.replace(batch, req_ids=list(scheduled))


def _idle_output(num_faults_seen: int) -> SchedulerOutput:
    idle = SchedulerOutput.make_empty()
    idle.kv_connector_metadata = KvspliceMetadata(num_faults_seen=num_faults_seen)
    return idle


def merged(first: KVConnectorOutput, later: KVConnectorOutput) -> KVConnectorOutput:
    """Two steps' worker outputs as one (what the scheduler hears over both)."""
    meta = first.kv_connector_worker_meta
    if meta is None or later.kv_connector_worker_meta is None:
        meta = meta or later.kv_connector_worker_meta
    else:
        meta = meta.aggregate(later.kv_connector_worker_meta)
    return dataclasses.replace(
        first,
        finished_recving=_union(first.finished_recving, later.finished_recving),
        finished_sending=_union(first.finished_sending, later.finished_sending),
        invalid_block_ids=first.invalid_block_ids | later.invalid_block_ids,
        failed_recving=first.failed_recving | later.failed_recving,
        kv_connector_worker_meta=meta,
    )


def _union(a: set[str] | None, b: set[str] | None) -> set[str] | None:
    union = set(a or ()) | set(b or ())
    return union or None


def kv_caches_like_vllm(
    config: VllmConfig, num_blocks: int, *, random: bool = False
) -> dict[str, torch.Tensor]:
    """A cache of the model's heads and head size, as vLLM 0.32 hands one to a connector.

    NOTE: the per-layer view `[num_blocks, H_kv, block_size, 2 * D]`
    (`vllm.v1.kv_cache_interface.create_kv_cache_views`). One layer, not the model's 30:
    the scheduler-level tests need the chain of keys in the sidecar, not a model's worth
    of K/V (1 MB a stored prefix instead of 36 MB, on a shared 2-core box).
    `random`: filled as a prefill would (the producer's), else zeros (cheap at 10k blocks).
    """
    model, parallel = config.model_config, config.parallel_config
    shape = (
        num_blocks,
        model.get_num_kv_heads(parallel),
        config.cache_config.block_size,
        2 * model.get_head_size(),
    )
    if random:  # what another engine computed (never read by a scheduler-level test)
        cache = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    else:
        cache = torch.zeros(shape, dtype=model.dtype)
    return {"model.layers.0.self_attn.attn": cache}
