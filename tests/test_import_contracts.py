"""scripts/check_layers.py: the contracts between rooms derive from the package list and the
floors, every package stands on a floor, and a forbidden import breaks a contract."""

from __future__ import annotations

import copy
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers.scripts import load_script


@pytest.fixture(scope="module")
def layers() -> ModuleType:
    return load_script("check_layers")


@pytest.fixture(scope="module")
def tree(layers: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mapped tree laid out once; each test edits a copy of one file and restores it."""
    target = tmp_path_factory.mktemp("layers")
    layers.lay_out(target)
    return target


def test_every_package_stands_on_a_floor_and_is_covered(layers: ModuleType) -> None:
    config = layers.read_config()
    covered = layers.floor_map(config).split()
    for package in config["tool"]["setuptools"]["packages"]:
        assert package == "kvsplice" or package in covered
    derived = layers.room_contracts(config)
    for room in ("integrations", "storeclient", "server", "client", "common"):
        assert f'"kvsplice.{room}' in derived


def test_a_package_on_no_floor_is_refused(layers: ModuleType) -> None:
    config: dict[str, Any] = copy.deepcopy(layers.read_config())
    config["tool"]["setuptools"]["packages"].append("kvsplice.newroom")
    with pytest.raises(ValueError, match="on no floor: newroom"):
        layers.room_contracts(config)


def test_the_tree_keeps_every_contract(layers: ModuleType, tree: Path) -> None:
    result = layers.lint(tree, layers.contracts())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and " 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("storeclient/config.py", "import torch", "never import torch or"),
        ("server/config.py", "import kvsplice.storeclient.client", "rooms point down"),
        ("common/units.py", "import kvsplice.server.config", "rooms point down"),
        ("integrations/vllm/lookups.py", "import kvsplice.client.reuse_engine", "rooms point"),
        ("integrations/vllm/lookups.py", "import kvsplice.server.config", "the engines"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(
    layers: ModuleType, tree: Path, module: str, line: str, broken: str
) -> None:
    source = tree / "kvsplice" / module
    original = source.read_text()
    source.write_text(original + f"\n{line}\n")
    try:
        result = layers.lint(tree, layers.contracts())
    finally:
        source.write_text(original)
    assert result.returncode != 0
    assert any(broken in line and "BROKEN" in line for line in _joined(result.stdout)), (
        result.stdout
    )


def _joined(report: str) -> list[str]:
    """lint-imports wraps long contract names over two lines: join each back to one."""
    lines, joined = report.splitlines(), []
    for line in lines:
        if joined and joined[-1].endswith(" ") and line and not line.startswith(" "):
            joined[-1] += line
        else:
            joined.append(line)
    return joined
