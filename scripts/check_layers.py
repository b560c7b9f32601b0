"""Run the import-linter contracts on the package as it is installed.

import-linter walks the `kvsplice` package directory, but our subpackages are
mapped from top-level folders (setuptools package-dir), so an editable install
hides them from it. This script lays the mapped tree out in a temp dir (copies
of the .py files) and runs `lint-imports` with that dir first on sys.path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvsplice-layers-") as tmp:
        lay_out(Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}
        lint = Path(sys.executable).with_name("lint-imports")
        command = [str(lint), "--config", str(ROOT / "pyproject.toml")]
        return subprocess.call(command, env=env, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
