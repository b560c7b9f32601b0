"""How each of vLLM's scheduler-level failure tests runs against kvsplice.

`FAULTS`: the kvsplice fault a test's scripted load failure becomes (`load_faults`);
`ASYNC_LOAD_TESTS`: tests whose script loads async (kvsplice runs `load_async="always"`);
`NEGATIVE_CONTROLS`: tests that also run with kvsplice's taint disabled and must fail;
`REQUIRED_HOOKS`: the kvsplice hooks a test must have run (the default: all of both halves).
"""

from __future__ import annotations

from hook_counts import SCHEDULER_HOOKS, WORKER_HOOKS

FAULTS = {
    # test_kv_load_failure_recovery.py
    "test_sync_load_failure": "corrupt",
    "test_sync_load_failure_with_shared_blocks": "evicted",
    "test_async_load_failure": "corrupt",
    "test_async_progressive_load_failure": "killed",
    "test_failed_receive_completion_honors_failure_policy": "killed",
    # test_invalid_blocks_correctness.py
    "test_sync_recompute_blocks_not_freed_for_running_requests": "killed",
    "test_sync_fail_invalid_blocks_evicted": "corrupt",
    "test_async_recompute_blocks_not_cached_when_invalid": "evicted",
    # test_cache_pollution_prevention.py
    "test_invalid_blocks_evicted_prevents_cache_pollution": "corrupt",
    # test_error_propagation.py
    "test_error_propagation_sync_load": "evicted",
    "test_error_propagation_async_load": "killed",
}
ASYNC_LOAD_TESTS = {
    "test_async_load_failure",
    "test_async_progressive_load_failure",
    "test_failed_receive_completion_honors_failure_policy",
    "test_async_recompute_blocks_not_cached_when_invalid",
    "test_error_propagation_async_load",
}
NEGATIVE_CONTROLS = {
    "test_sync_fail_invalid_blocks_evicted",
    "test_async_recompute_blocks_not_cached_when_invalid",
    "test_error_propagation_sync_load",
    "test_invalid_blocks_evicted_prevents_cache_pollution",
}
_ALL = (*SCHEDULER_HOOKS, *WORKER_HOOKS, "__init__(scheduler)", "__init__(worker)")
_NO_FINISH = tuple(h for h in _ALL if h != "request_finished")
REQUIRED_HOOKS: dict[str, tuple[str, ...]] = {
    "default": _ALL,
    # NOTE: these never finish a request (it waits for its load, or recomputes)
    "test_async_load_failure": _NO_FINISH,
    "test_async_progressive_load_failure": _NO_FINISH,
    "test_sync_load_failure_with_shared_blocks": _NO_FINISH,
    "test_sync_recompute_blocks_not_freed_for_running_requests": _NO_FINISH,
    "test_failed_receive_completion_honors_failure_policy": _NO_FINISH,
    "test_async_recompute_blocks_not_cached_when_invalid": _NO_FINISH,
    # the no-forward path of the model runner, a worker-role connector only
    "test_kv_connector_mixin_clears_metadata": (
        "__init__(worker)",
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "build_connector_worker_meta",
    ),
    # vLLM's scheduler refuses block-level errors on a two-group layout before any
    # connector is asked; kvsplice's scheduler half is only built (kvsplice is not HMA)
    "test_block_level_load_failure_fails_closed_with_multiple_groups": ("__init__(scheduler)",),
}
