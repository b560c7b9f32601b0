"""The `--kv-transfer-config` of each KV connector the engine benchmarks compare.

Owns the connectors' names, module paths and extra-config keys (kvsplice's connector,
LMCache's multi-process connector) and the engine flags a connector needs. Knows
nothing of how engines or stores are started.
"""

from __future__ import annotations

from typing import Any

KVSPLICE_MODULE = "kvsplice.integrations.vllm"
LMCACHE_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"
# LMCache's MP connector refuses vLLM's hybrid KV cache manager.
LMCACHE_ENGINE_ARGS = ("--disable-hybrid-kv-cache-manager",)


def transfer_config(connector: str, module: str | None, extra: dict[str, Any]) -> dict[str, Any]:
    """A connector in both roles (it saves and loads); a failed load is recomputed."""
    config: dict[str, Any] = {
        "kv_connector": connector, "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra,
    }  # fmt: skip
    if module is not None:
        config["kv_connector_module_path"] = module
    return config


def kvsplice_transfer(target: str, namespace: str, **extra: Any) -> dict[str, Any]:
    """`KvspliceConnector` to the sidecar at `target`; `extra`: more ConnectorConfig keys."""
    return transfer_config(
        "KvspliceConnector", KVSPLICE_MODULE, {"target": target, "namespace": namespace, **extra}
    )


def lmcache_transfer(port: int, *, save_decode: bool) -> dict[str, Any]:
    """LMCache's multi-process connector to its server on `port` (this host), looking up as
    soon as a request is queued (`eager_prefetch`: off by default, on for its best latency)."""
    extra = {
        "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
        "lmcache.mp.save_decode_cache": save_decode, "lmcache.mp.eager_prefetch": True,
    }  # fmt: skip
    return transfer_config("LMCacheMPConnector", LMCACHE_MODULE, extra)
