"""Real vLLM engines (separate processes) and a real sidecar, shared by this folder's tests.

Runs only where vLLM is installed (`make vllm` builds `.venv-vllm`; `make test` runs
this folder there). Engines take 25-60 s each to start on 2 cores, so one module
starts them once, all at the same time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make vllm; make test runs it)")

from kvsplice.eval.bench.vllm.bench import write_naive_policy
from kvsplice.eval.bench.vllm.engine import Engine, EngineSpec, Sidecar, free_port

NAMESPACE = "pipeline"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@dataclass(frozen=True)
class KvEventEndpoints:
    """Where engine `a` (vLLM's publisher) and the sidecar publish KV events."""

    engine: str
    sidecar: str
    sidecar_replay: str
    topic: str = "kv-events"

    def engine_config(self) -> str:
        """`--kv-events-config` of engine `a` (vLLM binds a `*` address)."""
        port = self.engine.rsplit(":", 1)[1]
        return json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "topic": self.topic,
            "endpoint": f"tcp://*:{port}",
        })  # fmt: skip

    def sidecar_args(self) -> tuple[str, ...]:
        return ("--kv-events-endpoint", self.sidecar, "--kv-events-replay-endpoint",
                self.sidecar_replay, "--kv-events-topic", self.topic)  # fmt: skip


@pytest.fixture(scope="module")
def kv_events() -> KvEventEndpoints:
    return KvEventEndpoints(*(f"tcp://127.0.0.1:{free_port()}" for _ in range(3)))


@pytest.fixture(scope="module")
def sidecar(
    tmp_path_factory: pytest.TempPathFactory, log_dir: Path, kv_events: KvEventEndpoints
) -> Iterator[Sidecar]:
    data = tmp_path_factory.mktemp("sidecar-lmdb")
    sidecar = Sidecar(data, free_port(), free_port(), log_dir, kv_events.sidecar_args()).start()
    yield sidecar
    sidecar.stop()


# The engines run as vLLM does by default: prefix caching on, async scheduling (0.32's
# default), chunked prefill (at most 512 tokens a step). float32, so that an output equal
# to the reference's proves the loaded K/V exact; a KV cache of 24 blocks (3,072 tokens)
# so that 16 concurrent requests of 300-1,000 tokens preempt.
KV_BLOCKS = 24
AS_VLLM_RUNS = {
    "enable_prefix_caching": True,
    "dtype": "float32",
    "max_model_len": 2048,
    "extra_args": (
        "--num-gpu-blocks-override",
        str(KV_BLOCKS),
        "--max-num-batched-tokens",
        "512",
    ),
    "log_stats": True,
    "env": {"VLLM_SERVER_DEV_MODE": "1"},  # POST /reset_prefix_cache
}


def connector_config(target: str, namespace: str = NAMESPACE, **extra: object) -> dict:
    """The connector as deployed (async loads), but chunks of one block: the tests' prompts
    (176-1,000 tokens) then load every full block, which their oracles count."""
    extra = {"chunk_tokens": 128, **extra}
    return {
        "kv_connector": "KvspliceConnector",
        "kv_connector_module_path": "kvsplice.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"target": target, "namespace": namespace, **extra},
    }


@pytest.fixture(scope="module")
def engines(
    model_dir: str, sidecar: Sidecar, log_dir: Path, tmp_path_factory: pytest.TempPathFactory,
    kv_events: KvEventEndpoints,
) -> Iterator[dict[str, Engine]]:  # fmt: skip
    """`reference` (no connector, no prefix cache: the dense oracle), `a` and `b` (the
    connector, one namespace, vLLM's defaults, a policy admitting approximate runs for
    requests that opt in): three processes. `a` publishes vLLM's KV events too."""
    path = tmp_path_factory.mktemp("policy") / "naive-policy.json"
    policy = str(write_naive_policy(model_dir, str(AS_VLLM_RUNS["dtype"]), path))
    deployed = connector_config(sidecar.target, reuse_policy=policy)
    engine_args = (*AS_VLLM_RUNS["extra_args"], "--kv-events-config", kv_events.engine_config())  # type: ignore[misc]
    publishing = {**AS_VLLM_RUNS, "extra_args": engine_args}
    specs = [
        EngineSpec("reference", model_dir, free_port(), dtype="float32"),
        EngineSpec("a", model_dir, free_port(), deployed, **publishing),  # type: ignore[arg-type]
        EngineSpec("b", model_dir, free_port(), deployed, **AS_VLLM_RUNS),  # type: ignore[arg-type]
    ]
    with started(specs, log_dir) as engines:
        yield engines


@contextmanager
def started(specs: list[EngineSpec], log_dir: Path) -> Iterator[dict[str, Engine]]:
    """The engines of `specs` by name, started at the same time, ready; stopped after."""
    engines = {spec.name: Engine(spec, log_dir).start() for spec in specs}
    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(lambda engine: engine.wait_ready(), engines.values()))
        yield engines
    finally:
        for engine in engines.values():
            engine.stop()
