"""Another engine stores a prefix in the sidecar, through kvsplice's own connector halves.

vLLM's tests script "the connector holds N tokens of this request"; here that becomes
true: a second scheduler with the same config, and a worker-role connector over a CPU
KV cache of the model's shape, prefill the tokens step by step (no model runs: the
K/V is random, which a scheduler-level test never reads), and kvsplice saves them as
an engine would. Only vLLM's connector API is used.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from worker_steps import kv_caches_like_vllm

NUM_SPARE_BLOCKS = 4
_request_ids = itertools.count()

CreateScheduler = Callable[..., Scheduler]
CreateOutput = Callable[..., ModelRunnerOutput]


@dataclasses.dataclass(frozen=True)
class PrefixProducer:
    """`store(vllm_config, token_ids)`: the sidecar then holds every whole chunk of them
    (with `kv_transfer_params`, as a request carrying them would save them).

    `create_scheduler` and `create_output` are vLLM's test helpers (`utils.py`).
    """

    create_scheduler: CreateScheduler
    create_output: CreateOutput
    eos_token_id: int

    def store(
        self,
        vllm_config: VllmConfig,
        token_ids: list[int],
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        config = copy.deepcopy(vllm_config)
        block_size = config.cache_config.block_size
        num_blocks = -(-len(token_ids) // block_size) + NUM_SPARE_BLOCKS
        scheduler = self.create_scheduler(config, num_blocks=num_blocks)
        worker = KVConnectorFactory.create_connector(
            config, KVConnectorRole.WORKER, scheduler.kv_cache_config
        )
        try:
            worker.register_kv_caches(kv_caches_like_vllm(config, num_blocks, random=True))
            request = self.request(token_ids, block_size)
            request.kv_transfer_params = kv_transfer_params
            scheduler.add_request(request)
            while scheduler.has_unfinished_requests():
                self._step(scheduler, worker, request)
        finally:
            worker.shutdown()  # drains the puts
            scheduler.shutdown()

    def request(self, token_ids: list[int], block_size: int) -> Request:
        """A request for `token_ids` as vLLM makes one (its block hashes too)."""
        sampling_params = SamplingParams(max_tokens=1)
        sampling_params.update_from_generation_config({}, self.eos_token_id)
        return Request(
            request_id=f"producer-{next(_request_ids)}",
            prompt_token_ids=token_ids,
            sampling_params=sampling_params,
            pooling_params=None,
            mm_features=None,
            block_hasher=get_request_block_hasher(block_size, sha256),
        )

    def _step(self, scheduler: Scheduler, worker: KVConnectorBase_V1, request: Request) -> None:
        """One step as vLLM's model runner drives a connector, without a forward pass."""
        output = scheduler.schedule()
        assert output.kv_connector_metadata is not None
        worker.bind_connector_metadata(output.kv_connector_metadata)
        worker.start_load_kv(None)  # type: ignore[arg-type]  # no forward context here
        worker.wait_for_save()
        runner_output = self.create_output(
            [request],
            invalid_block_ids=worker.get_block_ids_with_load_errors(),
            use_eos=True,
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
        )
        worker.clear_connector_metadata()
        if request.num_computed_tokens < request.num_prompt_tokens:  # prefill goes on
            runner_output = dataclasses.replace(runner_output, sampled_token_ids=[[]])
        scheduler.update_from_output(output, runner_output)
