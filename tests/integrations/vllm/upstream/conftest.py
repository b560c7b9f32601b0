"""vLLM's own connector tests, run against `KvspliceConnector` and an embedded sidecar.

Runs only where vLLM is installed (`make test` runs it in .venv-vllm). vLLM's test
modules are imported from its sdist (`vllm_unit_tests`), and their helpers are
patched for every test here: `create_vllm_config` names KvspliceConnector (the
bundled SmolLM2 as the model, a namespace of the test's own on the session's
sidecar), `create_mock_connector` returns a stand-in over the scheduler's real
connector (`connector_stand_in`), and ExampleConnector becomes kvsplice's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make vllm; make test runs it)")

from connector_stand_in import stand_in
from prefix_producer import PrefixProducer
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_unit_tests import RUN, fetched_sdist_root, import_unit_package

from kvsplice.server.embedded import EmbeddedStore, loopback_config

SDIST_ROOT = fetched_sdist_root()
UNIT = import_unit_package(SDIST_ROOT)

import vllm_kv_connector_unit.utils as utils  # noqa: E402  (registered just above)
from vllm_kv_connector_unit.conftest import _mock_cpu_backend_block_sizes  # noqa: E402, F401

CONNECTOR = {
    "kv_connector": "KvspliceConnector",
    "kv_connector_module_path": "kvsplice.integrations.vllm",
    "kv_role": "kv_both",
}
_namespaces = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_test: vLLM's mark for tests that need no GPU")


@pytest.fixture(scope="session")
def sidecar_target() -> Iterator[str]:
    with EmbeddedStore(loopback_config(None)) as store:
        yield store.target


@pytest.fixture(autouse=True)
def kvsplice_for_vllm_helpers(
    monkeypatch: pytest.MonkeyPatch, model_dir: str, sidecar_target: str
) -> Iterator[None]:
    """Point vLLM's test helpers at kvsplice for one test (a namespace of its own)."""
    extra = {"target": sidecar_target, "namespace": f"vllm-unit-{next(_namespaces)}"}
    schedulers: list[Scheduler] = []
    producer = PrefixProducer(
        utils.create_scheduler, utils.create_model_runner_output, utils.EOS_TOKEN_ID
    )
    helpers = {
        "create_vllm_config": _create_vllm_config(utils.create_vllm_config, model_dir, extra),
        "create_scheduler": _recording(utils.create_scheduler, schedulers),
        "create_mock_connector": _stand_in_factory(schedulers, producer),
        "ExampleConnector": _kvsplice_as_example_connector,
    }
    helpers["ExampleConnectorMetadata"] = _idle_step_metadata(
        helpers["create_vllm_config"], utils.create_scheduler
    )
    for module in _upstream_modules():
        for name, helper in helpers.items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, helper)
    yield
    for scheduler in schedulers:
        scheduler.shutdown()


def _upstream_modules() -> list[ModuleType]:
    """vLLM's utils and the test modules of it that run here (each imported its helpers)."""
    import importlib

    names = [f"{UNIT.__name__}.{name.removesuffix('.py')}" for name in RUN]
    return [utils, *(importlib.import_module(name) for name in names)]


def _create_vllm_config(original: Any, model_dir: str, extra: dict[str, str]) -> Any:
    """vLLM's `create_vllm_config` with KvspliceConnector where a test takes the default
    (NixlConnector), and the sidecar's settings added where it names its own connector."""

    def create_vllm_config(*args: Any, **kwargs: Any) -> Any:
        kwargs["model"] = model_dir  # facebook/opt-125m is not here; kvsplice hashes the files
        # NOTE: vLLM's tests script hits of any whole number of blocks, loaded in the step
        # (sync): kvsplice agrees with a script only with chunks of one block and sync loads.
        ours = {**extra, "chunk_tokens": kwargs.get("block_size", 16), "load_async": "never"}
        if kwargs.get("kv_connector", "NixlConnector") == "NixlConnector":
            kwargs.update(CONNECTOR, kv_connector_extra_config=ours)
        else:
            kwargs["kv_connector_extra_config"] = {
                **(kwargs.get("kv_connector_extra_config") or {}),
                **ours,
            }
        return original(*args, **kwargs)

    return create_vllm_config


def _recording(create_scheduler: Any, schedulers: list[Scheduler]) -> Any:
    def recording_create_scheduler(*args: Any, **kwargs: Any) -> Scheduler:
        schedulers.append(create_scheduler(*args, **kwargs))
        return schedulers[-1]

    return recording_create_scheduler


def _stand_in_factory(schedulers: list[Scheduler], producer: PrefixProducer) -> Any:
    """`create_mock_connector`: vLLM's tests install its Mock in the scheduler they made
    last, so the stand-in wraps that scheduler's own connector."""

    def create_stand_in() -> Any:
        scheduler = schedulers[-1]
        return stand_in(
            scheduler.connector,
            lambda token_ids: producer.store(scheduler.vllm_config, token_ids),
        )

    return create_stand_in


def _idle_step_metadata(create_vllm_config: Any, create_scheduler: Any) -> Any:
    """What kvsplice's scheduler half sends workers for a step without requests."""

    def idle_step_metadata() -> Any:
        scheduler = create_scheduler(create_vllm_config())
        try:
            return scheduler.schedule().kv_connector_metadata
        finally:
            scheduler.shutdown()

    return idle_step_metadata


def _kvsplice_as_example_connector(vllm_config: Any, role: Any, kv_cache_config: Any) -> Any:
    """KvspliceConnector inside vLLM's call-recording `TestExampleConnector`.

    That wrapper reads its `name` from the extra config, a key kvsplice refuses.
    """
    from kvsplice.integrations.vllm import KvspliceConnector

    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    name = extra.pop("name", None)
    try:
        return KvspliceConnector(vllm_config, role, kv_cache_config)
    finally:
        if name is not None:
            extra["name"] = name
