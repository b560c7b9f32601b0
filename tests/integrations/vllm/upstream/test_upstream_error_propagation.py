"""vLLM's `test_error_propagation.py` run against kvsplice: a failed load under the
`fail` policy ends the request with FINISHED_ERROR.

The sync test's hit is kvsplice's own (held in the sidecar, looked up); the async
test keeps its scripted async load (kvsplice never loads asynchronously).
"""

from vllm_kv_connector_unit.test_error_propagation import (
    fail_scheduler,
    test_error_propagation_async_load,
    test_error_propagation_sync_load,
)

__all__ = [
    "fail_scheduler",
    "test_error_propagation_async_load",
    "test_error_propagation_sync_load",
]
