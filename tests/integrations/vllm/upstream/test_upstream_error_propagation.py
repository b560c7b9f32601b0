"""vLLM's `test_error_propagation.py` run against kvsplice: a failed load under the
`fail` policy ends the request with FINISHED_ERROR.

Both hits are kvsplice's own (held in the sidecar, looked up; the async one loaded on its
background thread); the failures are kvsplice's: a segment evicted before the sync load,
the sidecar killed mid-way through the async one (`failure_plan`).
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
