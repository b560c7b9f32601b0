"""vLLM's own connector tests, run against `KvspliceConnector` and an embedded sidecar.

Runs only where vLLM is installed (`make test` runs it in .venv-vllm). vLLM's test
modules are imported from its sdist (`vllm_unit_tests`), and their helpers are
patched for every test here (a helper missing or renamed fails the test):
`create_vllm_config` names KvspliceConnector (the bundled SmolLM2 as the model, a
namespace of the test's own), `create_scheduler` puts kvsplice's worker half behind the
scheduler (`kvsplice_behind`: a scripted load failure becomes a kvsplice fault,
`load_faults`), `create_mock_connector` returns a stand-in over the scheduler's real
connector (`connector_stand_in`), and ExampleConnector becomes kvsplice's. After each
test: kvsplice's hooks ran (`hook_counts`), it agreed with the script, and its own
outcomes hold (`failure_outcomes`).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (make vllm; make test runs it)")

from connector_stand_in import stand_in
from failure_outcomes import check_outcomes, disable_taint
from failure_plan import ASYNC_LOAD_TESTS, FAULTS, NEGATIVE_CONTROLS, REQUIRED_HOOKS
from hook_counts import HookCounts
from kvsplice_behind import KvspliceBehind
from load_faults import LoadFaults
from prefix_producer import PrefixProducer
from vllm.v1.core.sched.scheduler import Scheduler
from vllm_unit_tests import RUN, fetched_sdist_root, import_unit_package
from worker_steps import RUNNERS, WorkerBehind

from kvsplice.integrations.vllm import KvspliceConnector
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
# utils' helpers every test gets kvsplice's version of; the others vLLM's tests may use
PATCHED = ("create_vllm_config", "create_scheduler", "create_mock_connector", "ExampleConnector")
UNPATCHED = ("create_request", "create_model_runner_output", "make_kv_cache_config")
REPORT_PATH = os.environ.get("KVSPLICE_UPSTREAM_REPORT")  # JSON lines: one per test
_namespaces = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cpu_test: vLLM's mark for tests that need no GPU")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """vLLM's failure tests under both model runners' call orders; a few also with
    kvsplice's taint disabled (`taint="off"`: they must fail, see pytest_pyfunc_call)."""
    name = metafunc.function.__name__
    if name in FAULTS:
        variants = [(runner, "on") for runner in RUNNERS]
        if name in NEGATIVE_CONTROLS:
            variants.append(("v1", "off"))
        metafunc.parametrize(("model_runner", "taint"), variants, indirect=True)


@pytest.fixture
def model_runner(request: pytest.FixtureRequest) -> str:
    return getattr(request, "param", "v1")


@pytest.fixture
def taint(request: pytest.FixtureRequest) -> str:
    return getattr(request, "param", "on")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """With kvsplice's taint disabled, vLLM's own assertions must fail (in vLLM's file)."""
    if pyfuncitem.funcargs.get("taint") != "off":
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    with pytest.raises(AssertionError) as failure:
        pyfuncitem.obj(**args)
    where = str(failure.traceback[-1].path)
    assert where.startswith(str(SDIST_ROOT)), f"failed in {where}, not in vLLM's test"
    pyfuncitem.user_properties.append(("negative_control_failure", str(failure.value)[:200]))
    return True


@pytest.fixture(scope="session")
def session_sidecar() -> Iterator[EmbeddedStore]:
    with EmbeddedStore(loopback_config(None)) as store:
        yield store


@pytest.fixture
def sidecar(
    request: pytest.FixtureRequest, session_sidecar: EmbeddedStore
) -> Iterator[EmbeddedStore]:
    """The session's sidecar, or one of the test's own where the test kills it."""
    if FAULTS.get(request.node.originalname) != "killed":
        yield session_sidecar
        return
    with EmbeddedStore(loopback_config(None)) as store:
        yield store


@pytest.fixture(autouse=True)
def kvsplice_for_vllm_helpers(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, model_dir: str,
    sidecar: EmbeddedStore, session_sidecar: EmbeddedStore, model_runner: str, taint: str,
) -> Iterator[None]:  # fmt: skip
    """Point vLLM's test helpers at kvsplice for one test (a namespace of its own)."""
    test_name = request.node.originalname
    load_async = "always" if test_name in ASYNC_LOAD_TESTS else "never"
    extra = {"target": sidecar.target, "namespace": f"vllm-unit-{next(_namespaces)}"}
    counts = HookCounts()
    counts.install(monkeypatch)
    if taint == "off":
        disable_taint(monkeypatch)
    kind = FAULTS.get(test_name)
    faults = (
        None
        if kind is None
        else LoadFaults(kind, sidecar, owns_sidecar=sidecar is not session_sidecar)
    )
    behind: list[KvspliceBehind] = []
    stand_ins: list[Any] = []
    producer = PrefixProducer(
        utils.create_scheduler, utils.create_model_runner_output, utils.EOS_TOKEN_ID
    )
    helpers = {
        "create_vllm_config": _create_vllm_config(
            utils.create_vllm_config, model_dir, extra, load_async
        ),
        "create_scheduler": _behind(
            utils.create_scheduler, behind, faults, stand_ins, model_runner
        ),
        "create_mock_connector": _stand_in_factory(behind, producer, counts, stand_ins),
        "ExampleConnector": _kvsplice_as_example_connector,
    }
    helpers["ExampleConnectorMetadata"] = _idle_step_metadata(
        helpers["create_vllm_config"], utils.create_scheduler
    )
    _patch_helpers(monkeypatch, helpers)
    yield
    with counts.paused():
        try:
            if taint == "on" and request.node.function.__module__.startswith(UNIT.__name__):
                required = REQUIRED_HOOKS.get(test_name, REQUIRED_HOOKS["default"])
                missing = counts.missing(required)
                assert not missing, f"kvsplice's hooks {missing} never ran ({dict(counts.counts)})"
            outcomes = {} if taint == "off" else check_outcomes(behind, faults, producer)
            _report(request, counts, kind, model_runner, taint, outcomes)
        finally:
            for each in behind:
                each.worker.shutdown()
                each.scheduler.shutdown()


def _patch_helpers(monkeypatch: pytest.MonkeyPatch, helpers: dict[str, Any]) -> None:
    """Every helper replaced wherever vLLM's modules hold it; a helper gone from utils,
    or a `create_*`/`make_*` of utils a test module uses that is neither patched nor
    known to need none, fails the test (a renamed helper would bypass kvsplice)."""
    originals = {}
    for name in (*PATCHED, *UNPATCHED):
        if not hasattr(utils, name):
            pytest.fail(f"vLLM's test utils have no {name} any more: adapt conftest.py")
        originals[name] = getattr(utils, name)
    for module in _upstream_modules():
        for attr, value in vars(module).items():
            if (
                attr.startswith(("create_", "make_"))
                and attr not in originals
                and module is not utils
            ):
                pytest.fail(
                    f"{module.__name__} uses utils' {attr}, which conftest.py does not know"
                )
            for name, original in originals.items():
                if value is original and name in helpers:
                    monkeypatch.setattr(module, attr, helpers[name])
        if hasattr(module, "ExampleConnectorMetadata"):
            monkeypatch.setattr(
                module, "ExampleConnectorMetadata", helpers["ExampleConnectorMetadata"]
            )
    lifecycle = vars(UNIT).get("test_kv_connector_lifecycle")
    if lifecycle is not None and not hasattr(lifecycle, "ExampleConnectorMetadata"):
        pytest.fail(
            "vLLM's lifecycle test no longer uses ExampleConnectorMetadata: adapt conftest.py"
        )


def _upstream_modules() -> list[ModuleType]:
    """vLLM's utils and the test modules of it that run here (each imported its helpers)."""
    import importlib

    names = [f"{UNIT.__name__}.{name.removesuffix('.py')}" for name in RUN]
    return [utils, *(importlib.import_module(name) for name in names)]


def _create_vllm_config(
    original: Any, model_dir: str, extra: dict[str, str], load_async: str
) -> Any:
    """vLLM's `create_vllm_config` with KvspliceConnector where a test takes the default
    (NixlConnector), and the sidecar's settings added where it names its own connector."""

    def create_vllm_config(*args: Any, **kwargs: Any) -> Any:
        kwargs["model"] = model_dir  # facebook/opt-125m is not here; kvsplice hashes the files
        # NOTE: vLLM's tests script hits of any whole number of blocks: kvsplice agrees with
        # a script only with chunks of one block. Async tests start on an idle engine, where
        # "auto" loads in the step: they run "always".
        ours = {**extra, "chunk_tokens": kwargs.get("block_size", 16), "load_async": load_async}
        if kwargs.get("kv_connector", "NixlConnector") == "NixlConnector":
            kwargs.update(CONNECTOR, kv_connector_extra_config=ours)
        else:
            kwargs["kv_connector_extra_config"] = {
                **(kwargs.get("kv_connector_extra_config") or {}),
                **ours,
            }
        return original(*args, **kwargs)

    return create_vllm_config


def _behind(
    create_scheduler: Any, behind: list[KvspliceBehind], faults: LoadFaults | None,
    stand_ins: list[Any], runner: str,
) -> Any:  # fmt: skip
    def create_scheduler_with_kvsplice_behind(*args: Any, **kwargs: Any) -> Scheduler:
        scheduler = create_scheduler(*args, **kwargs)
        worker = WorkerBehind(scheduler, runner)
        behind.append(
            KvspliceBehind(scheduler, worker, faults, lambda c: any(c is s for s in stand_ins))
        )
        return scheduler

    return create_scheduler_with_kvsplice_behind


def _stand_in_factory(
    behind: list[KvspliceBehind], producer: PrefixProducer, counts: HookCounts, stand_ins: list[Any]
) -> Any:
    """`create_mock_connector`: vLLM's tests install its Mock in the scheduler they made
    last, so the stand-in wraps that scheduler's own connector."""

    def create_stand_in() -> Any:
        last = behind[-1]

        def seed(token_ids: list[int]) -> None:
            with counts.paused():  # another engine's hooks
                producer.store(last.scheduler.vllm_config, token_ids)

        stand_ins.append(stand_in(last.kvsplice, seed))
        return stand_ins[-1]

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
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    name = extra.pop("name", None)
    try:
        return KvspliceConnector(vllm_config, role, kv_cache_config)
    finally:
        if name is not None:
            extra["name"] = name


def _report(
    request: pytest.FixtureRequest, counts: HookCounts, kind: str | None, runner: str,
    taint: str, outcomes: dict[str, Any],
) -> None:  # fmt: skip
    if REPORT_PATH is None:
        return
    line = {
        "test": request.node.nodeid.split("::")[-1], "module": request.node.module.__name__,
        "fault": kind, "runner": runner, "taint": taint, "hooks": dict(sorted(counts.counts.items())),
        **outcomes,
    }  # fmt: skip
    with open(REPORT_PATH, "a") as out:
        out.write(json.dumps(line) + "\n")
