"""vLLM 0.32.0's connector unit tests (`tests/v1/kv_connector/unit`), importable here.

They come from vLLM's sdist (`scripts/fetch_vllm_tests.py` fetches and checks it) and
are imported from there, never copied, as the package `vllm_kv_connector_unit`: our
own suite has a top-level `tests` too. Also says which of vLLM's files run here and
which do not apply to kvsplice, and why. Knows nothing of how they are adapted.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "vllm_kv_connector_unit"
UNIT_DIR = Path("tests/v1/kv_connector/unit")
FETCH_SCRIPT = Path(__file__).resolve().parents[4] / "scripts" / "fetch_vllm_tests.py"

# vLLM's file -> our module that runs its tests (every test function in it).
RUN = {
    "test_cache_pollution_prevention.py": "test_upstream_cache_pollution.py",
    "test_error_propagation.py": "test_upstream_error_propagation.py",
    "test_invalid_blocks_correctness.py": "test_upstream_invalid_blocks.py",
    "test_kv_connector_lifecycle.py": "test_upstream_connector_lifecycle.py",
    "test_kv_load_failure_recovery.py": "test_upstream_load_failure_recovery.py",
}

_NIXL = "NixlConnector's own code (handshakes, NIXL transfers, P/D over kv_transfer_params)"
_MOONCAKE = "Mooncake's connectors and store (transfer engine, its own coordinator)"
_MORIIO = "MoRIIO's connector (RDMA writes, its proxy and routing)"
_P_D = (
    "disaggregated prefill/decode: a remote engine's KV fetched asynchronously after "
    "`do_remote_prefill`/`do_remote_decode` kv_transfer_params; kvsplice is a prefix cache "
    "(kv_both) that reads no kv_transfer_params and never delays a free"
)
# vLLM's file or folder -> why it does not apply to kvsplice.
NOT_APPLICABLE = {
    "test_bidirectional_kv_transfer.py": _NIXL,
    "offloading_connector": "OffloadingConnector's own code (a folder of tests)",
    "test_config.py": "`kv_offloading_backend` turned into Offloading, LMCacheMP or Nixl configs",
    "test_decode_bench_connector.py": "DecodeBenchConnector's own code",
    "test_example_connector.py": (
        "end to end with ExampleConnector's disk store and a 3B vision model from the Hub "
        "(kvsplice's engine tests run real engines instead: tests/integrations/vllm/engine)"
    ),
    "test_flexkv_connector.py": "FlexKV's connector",
    "test_handshake_pp_aggregation.py": "handshake metadata across pipeline stages (kvsplice has no handshake, refuses PP>1)",
    "test_hf3fs_client.py": "HF3FS's client",
    "test_hf3fs_connector.py": "HF3FS's connector",
    "test_hf3fs_metadata_server.py": "HF3FS's metadata server",
    "test_hidden_states_connector.py": "a connector of hidden states, not KV",
    "test_hisparse_connector.py": "HiSparse's connector",
    "test_hisparse_stats.py": "HiSparse's statistics",
    "test_hma_auto_config.py": (
        "which built-in connectors keep the hybrid allocator (its cases name "
        "SimpleCPUOffload, Offloading, Example and MultiConnector); kvsplice is not "
        "SupportsHMA, so vLLM turns the allocator off, as every test here logs"
    ),
    "test_lmcache_connector.py": "LMCache's connector",
    "test_lmcache_integration.py": "LMCache's integration",
    "test_mooncake_connector.py": _MOONCAKE,
    "test_mooncake_connector_hma.py": _MOONCAKE,
    "test_mooncake_connector_hybrid_mamba.py": _MOONCAKE,
    "test_mooncake_stats.py": _MOONCAKE,
    "test_mooncake_store_connector.py": _MOONCAKE,
    "test_mooncake_store_coordinator.py": _MOONCAKE,
    "test_mooncake_store_hma_e2e.py": _MOONCAKE,
    "test_mooncake_store_layout.py": _MOONCAKE,
    "test_mooncake_store_scheduler.py": _MOONCAKE,
    "test_mooncake_store_worker.py": _MOONCAKE,
    "test_moriio_connector.py": _MORIIO,
    "test_moriio_hma_scheduler.py": _MORIIO,
    "test_moriio_kv_layout.py": _MORIIO,
    "test_moriio_proxy_routing.py": _MORIIO,
    "test_moriio_routing.py": _MORIIO,
    "test_moriio_routing_fairness.py": _MORIIO,
    "test_moriio_toy_proxy_server.py": _MORIIO,
    "test_moriio_tp_ack.py": _MORIIO,
    "test_moriio_transfer_completion.py": _MORIIO,
    "test_moriio_unmap.py": _MORIIO,
    "test_moriio_write_done_routing.py": _MORIIO,
    "test_multi_connector.py": "MultiConnector composing Nixl, Offloading and its own mocks",
    "test_nixl_connector.py": _NIXL,
    "test_nixl_connector_hma.py": _NIXL,
    "test_nixl_desc_geometry.py": _NIXL,
    "test_nixl_heartbeat.py": _NIXL,
    "test_nixl_push_connector.py": _NIXL,
    "test_nixl_rocm_gpu_mem_diag.py": _NIXL,
    "test_nixl_simple_cpu_offload.py": _NIXL,
    "test_offloading_connector.py": "OffloadingConnector's own code",
    "test_output_aggregator.py": (
        "vLLM's aggregation of several workers' outputs; no connector takes part "
        "(kvsplice runs one worker: TP=PP=1)"
    ),
    "test_remote_decode_lifecycle.py": _P_D,
    "test_remote_prefill_lifecycle.py": _P_D,
    "test_scheduler_kv_connector_override.py": (
        "a scheduler plugin with a connector of the test's own; it also imports "
        "tests/v1/core, which is not this folder"
    ),
    "test_simple_cpu_offload_connector.py": "SimpleCPUOffloadConnector's own code",
    "test_simple_cpu_offload_metrics.py": "SimpleCPUOffloadConnector's metrics",
    "test_tp_mapping.py": "P/D transfer plans across tensor-parallel ranks (kvsplice refuses TP>1)",
    "test_transfer_topology_sharded.py": "P/D TransferTopology across pipeline ranks (PP>1)",
}


def unit_dir(sdist_root: Path) -> Path:
    return sdist_root / UNIT_DIR


def fetched_sdist_root() -> Path:
    """The unpacked sdist, fetched first where it is not cached yet."""
    fetch = _load_module("fetch_vllm_tests", FETCH_SCRIPT)
    return fetch.fetch_tests(fetch.cache_dir_from_env())


def import_unit_package(sdist_root: Path) -> ModuleType:
    """Register vLLM's unit-test folder as `vllm_kv_connector_unit`, so that its modules'
    relative imports (`from .utils import ...`) resolve inside it."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE]
    folder = unit_dir(sdist_root)
    spec = importlib.util.spec_from_file_location(
        PACKAGE, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    spec.loader.exec_module(package)
    return package


def _load_module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
