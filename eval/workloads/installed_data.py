"""Data files inside installed packages, found without importing them (never downloaded).

Owns the lookup and its error; what a file holds is each workload's to read.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


class DatasetNotInstalledError(FileNotFoundError):
    """A data package, or a file it should hold, is missing; the message says how to install it."""


def installed_data_path(package: str, relative: Path, install_hint: str) -> Path:
    """`relative` (a file or a directory) inside the installed `package`; else
    `DatasetNotInstalledError` naming `install_hint`. Nothing is imported: some data
    packages are installed `--no-deps` and would not import."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotInstalledError(f"package {package!r} is not installed: {install_hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise DatasetNotInstalledError(f"{path} is missing from {package!r}: {install_hint}")
    return path
