"""Every file of vLLM's connector unit tests either runs here or says why it does not apply."""

from __future__ import annotations

import importlib

from vllm_unit_tests import NOT_APPLICABLE, PACKAGE, RUN, fetched_sdist_root, unit_dir

UNIT_DIR = unit_dir(fetched_sdist_root())


def test_every_file_runs_or_does_not_apply() -> None:
    entries = {
        path.name
        for path in UNIT_DIR.iterdir()
        if path.name.startswith("test_") or (path.is_dir() and path.name != "__pycache__")
    }
    assert not RUN.keys() & NOT_APPLICABLE.keys()
    assert entries == RUN.keys() | NOT_APPLICABLE.keys()


def test_every_test_of_a_file_that_runs_runs() -> None:
    for theirs, ours in RUN.items():
        upstream = importlib.import_module(f"{PACKAGE}.{theirs.removesuffix('.py')}")
        here = importlib.import_module(ours.removesuffix(".py"))
        tests = {name for name in vars(upstream) if name.startswith("test_")}
        assert tests <= set(vars(here)), f"{ours} leaves out {sorted(tests - set(vars(here)))}"
