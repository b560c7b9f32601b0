"""vLLM's `test_cache_pollution_prevention.py`, its one test run against kvsplice.

A sync load kvsplice promised (99 of 100 blocks, held in the sidecar) fails at block
50 under the `fail` policy: vLLM must evict that block and every later one from its
prefix cache. The failure is a corrupt record kvsplice's check catches (and deletes).
"""

from vllm_kv_connector_unit.test_cache_pollution_prevention import (
    fail_scheduler,
    test_invalid_blocks_evicted_prevents_cache_pollution,
)

__all__ = ["fail_scheduler", "test_invalid_blocks_evicted_prevents_cache_pollution"]
