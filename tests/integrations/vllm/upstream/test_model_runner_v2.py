"""The V2 model runner's connector calls that vLLM's failure tests do not make, on kvsplice's worker half.

vLLM's failure tests already run each step through V2's `ActiveKVConnector` (`[v2-...]`);
here: `set_disabled` (V2's dummy runs and warmup) and `reset_capture_state` (CUDA graph
capture) around a step, and a step with V2's `start_load_kv` keywords.
"""

from __future__ import annotations

from typing import Any

import vllm_kv_connector_unit.utils as utils
import worker_steps
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from worker_steps import WorkerBehind

from kvsplice.integrations.vllm import KvspliceConnector


def test_v2_disables_and_captures_around_kvsplice(monkeypatch: Any) -> None:
    scheduler = utils.create_scheduler(utils.create_vllm_config())  # kvsplice's (conftest)
    worker = WorkerBehind(scheduler, "v2")
    calls: list[dict[str, Any]] = []
    start = KvspliceConnector.start_load_kv
    monkeypatch.setattr(
        KvspliceConnector, "start_load_kv",
        lambda self, ctx, **kwargs: (calls.append(kwargs), start(self, ctx, **kwargs))[1],
    )  # fmt: skip
    try:
        active = worker._v2
        assert active is not None
        with worker.agent():
            active.set_disabled(True)  # a dummy run: no connector call reaches kvsplice
            assert not has_kv_transfer_group()
            assert active.no_forward(SchedulerOutput.make_empty()) is EMPTY_MODEL_RUNNER_OUTPUT
            assert calls == []
            active.set_disabled(False)
            assert get_kv_transfer_group() is worker.connector
            active.reset_capture_state()
        request = utils.create_request(num_tokens=3 * scheduler.block_size)
        scheduler.add_request(request)
        output = scheduler.schedule()  # a prefill with a forward pass (an InputBatch)
        assert worker.step(output).invalid_block_ids == set()
        assert calls and set(calls[-1]) == {
            "scheduler_output", "request_state_indices", "request_ids", "num_tokens",
        }  # fmt: skip
        assert calls[-1]["request_ids"] == [request.request_id]
        # a step whose forward built attention metadata: V2 hands it on too
        scheduler.add_request(utils.create_request(num_tokens=2 * scheduler.block_size))
        step = scheduler.schedule()
        with worker.agent():
            active.pre_forward(step, worker_steps.input_batch(step), attn_metadata={})
            active.finish_forward()
            assert active.post_forward(step.finished_req_ids) is not None
        assert set(calls[-1]) >= {"attn_metadata", "request_ids"}
    finally:
        worker.shutdown()
