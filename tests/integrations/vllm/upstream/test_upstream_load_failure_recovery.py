"""vLLM's `test_kv_load_failure_recovery.py` run against kvsplice.

The sync tests' hits are kvsplice's own: three requests each held for 99 of 100 blocks,
or one held and a second sharing its first 50 blocks (vLLM's prefix cache covers
those; kvsplice must then promise nothing more), and the async tests' loads run on
kvsplice's background thread. Each scripted failure is a kvsplice fault (`failure_plan`).
"""

from vllm_kv_connector_unit.test_kv_load_failure_recovery import (
    scheduler,
    test_async_load_failure,
    test_async_progressive_load_failure,
    test_block_level_load_failure_fails_closed_with_multiple_groups,
    test_failed_receive_completion_honors_failure_policy,
    test_sync_load_failure,
    test_sync_load_failure_with_shared_blocks,
)

__all__ = [
    "scheduler",
    "test_async_load_failure",
    "test_async_progressive_load_failure",
    "test_block_level_load_failure_fails_closed_with_multiple_groups",
    "test_failed_receive_completion_honors_failure_policy",
    "test_sync_load_failure",
    "test_sync_load_failure_with_shared_blocks",
]
