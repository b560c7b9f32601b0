"""vLLM's `test_kv_connector_lifecycle.py` run against kvsplice's worker half.

vLLM's call-recording wrapper holds a worker-role KvspliceConnector instead of
ExampleConnector, and the idle step's metadata is what kvsplice's scheduler half
builds for a step without requests: the model runner's no-forward path must bind,
save and clear it once each.
"""

from vllm_kv_connector_unit.test_kv_connector_lifecycle import (
    test_kv_connector_mixin_clears_metadata,
)

__all__ = ["test_kv_connector_mixin_clears_metadata"]
