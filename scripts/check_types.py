"""Run mypy on the `kvsplice` package as it is installed, with its real import names.

Our subpackages are mapped from top-level folders (setuptools package-dir), which an
editable install hides from mypy. This script lays the mapped tree out as symlinks under
build/mypy-tree (stable, so mypy's cache in .mypy_cache stays warm), runs mypy there on
the packages STYLE.md holds to be type-clean, and prints each error with its path in the
repository (`common/x.py`, not `kvsplice/common/x.py`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from check_layers import ROOT, package_dirs

TREE = ROOT / "build" / "mypy-tree"
CHECKED = (
    "common",
    "storage",
    "index",
    "server",
    "storeclient",
    "client",
    "integrations",
    "kvmath",
)


def link_tree(target: Path) -> None:
    """Mirror every mapped package as a directory of symlinks to its source files."""
    shutil.rmtree(target, ignore_errors=True)
    mapping = package_dirs()
    for name, folder in mapping.items():
        destination = target.joinpath(*name.split("."))
        destination.mkdir(parents=True, exist_ok=True)
        for source in folder.iterdir():
            mapped_elsewhere = f"{name}.{source.name}" in mapping
            if source.name == "__pycache__" or mapped_elsewhere:
                continue
            is_module = source.suffix in (".py", ".pyi")
            is_package = source.is_dir() and any(source.rglob("*.py"))
            if is_module or is_package:
                (destination / source.name).symlink_to(source)


def repository_paths(line: str) -> str:
    """`kvsplice/common/x.py:3: error` -> `common/x.py:3: error`."""
    for name, folder in sorted(package_dirs().items(), key=lambda item: -len(item[0])):
        prefix = name.replace(".", "/") + "/"
        if line.startswith(prefix):
            return folder.relative_to(ROOT).as_posix() + "/" + line[len(prefix) :]
    return line


def main() -> int:
    link_tree(TREE)
    packages = [arg for name in CHECKED for arg in ("-p", f"kvsplice.{name}")]
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    command += ["--cache-dir", str(ROOT / ".mypy_cache"), *packages]
    result = subprocess.run(command, cwd=TREE, capture_output=True, text=True)
    for line in (result.stdout + result.stderr).splitlines():
        print(repository_paths(line))
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
