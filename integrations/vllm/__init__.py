"""kvsplice inside vLLM: `KvspliceConnector`, a KV connector that shares exact-prefix KV
through the kvsplice sidecar. Load it with
`kv_transfer_config={"kv_connector": "KvspliceConnector",
"kv_connector_module_path": "kvsplice.integrations.vllm", "kv_role": "kv_both", ...}`.

vLLM is imported only when the connector class is asked for, so the torch-free parts
(config, key chain, scheduler bookkeeping) import and test without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvspliceConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvspliceConnector":
        from kvsplice.integrations.vllm.connector import KvspliceConnector

        return KvspliceConnector
    raise AttributeError(name)
