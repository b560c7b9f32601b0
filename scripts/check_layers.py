"""Run the import-linter contracts on the package as it is installed.

import-linter walks the `kvsplice` package directory, but our subpackages are
mapped from top-level folders (setuptools package-dir), so an editable install
hides them from it. This script lays the mapped tree out in a temp dir (copies
of the .py files) and runs `lint-imports` with that dir first on sys.path.

Beside pyproject's contracts it adds one it derives from the tree: the reuse modes
stand alone. A mode is a module of client/modes (or a folder of it) that declares
`SPEC = ModeSpec(...)`; no mode may import another, directly or through other modules
(what several modes share lives in client/modes/shared.py, which imports none).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ROOT / "client" / "modes"
MODE_PACKAGE = "kvsplice.client.modes"
DECLARES_MODE = re.compile(r"^SPEC = ModeSpec\(", re.MULTILINE)


def package_dirs() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping = config["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def lay_out(target: Path) -> None:
    for name, folder in package_dirs().items():
        destination = target.joinpath(*name.split("."))
        destination.mkdir(parents=True, exist_ok=True)
        for source in folder.rglob("*.py"):
            relative = source.relative_to(folder)
            (destination / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / relative)


def mode_modules() -> list[str]:
    """The importable names of the reuse modes: modules (or folders) declaring a `SPEC`."""
    found = set()
    for source in MODES.rglob("*.py"):
        if DECLARES_MODE.search(source.read_text()):
            relative = source.relative_to(MODES)
            top = relative.parts[0] if len(relative.parts) > 1 else relative.stem
            found.add(f"{MODE_PACKAGE}.{top}")
    return sorted(found)


def modes_contract(modes: list[str]) -> str:
    listed = ", ".join(f'"{m}"' for m in modes)
    return (
        "\n[[tool.importlinter.contracts]]\n"
        'name = "reuse modes stand alone: no mode imports another (shared code: modes.shared)"\n'
        'type = "independence"\n'
        f"modules = [{listed}]\n"
    )


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvsplice-layers-") as tmp:
        lay_out(Path(tmp))
        config = Path(tmp) / "contracts.toml"
        pyproject = (ROOT / "pyproject.toml").read_text()
        config.write_text(pyproject + modes_contract(mode_modules()))
        env = {**os.environ, "PYTHONPATH": tmp}
        lint = Path(sys.executable).with_name("lint-imports")
        return subprocess.call([str(lint), str(config)], env=env, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
