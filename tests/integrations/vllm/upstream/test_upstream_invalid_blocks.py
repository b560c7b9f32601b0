"""vLLM's `test_invalid_blocks_correctness.py` run against kvsplice.

Sync recompute (blocks stay allocated, the request recomputes from the bad block), sync
fail (bad blocks evicted, the request errors) and async recompute use kvsplice's own hits
and its own failures (sidecar killed mid-load, corrupt record, evicted segment).
"""

from vllm_kv_connector_unit.test_invalid_blocks_correctness import (
    fail_scheduler,
    recompute_scheduler,
    test_async_recompute_blocks_not_cached_when_invalid,
    test_sync_fail_invalid_blocks_evicted,
    test_sync_recompute_blocks_not_freed_for_running_requests,
)

__all__ = [
    "fail_scheduler",
    "recompute_scheduler",
    "test_async_recompute_blocks_not_cached_when_invalid",
    "test_sync_fail_invalid_blocks_evicted",
    "test_sync_recompute_blocks_not_freed_for_running_requests",
]
