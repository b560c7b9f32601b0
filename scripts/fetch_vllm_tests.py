"""Fetch vLLM 0.32.0's own tests (or its benchmark scripts) from its source distribution.

The wheel ships neither; the sdist (44 MB) does. It is downloaded once into a cache
directory (`KVSPLICE_CACHE`, else ~/.cache/kvsplice), checked against the sha256 the
index lists, and only the folders asked for are unpacked (`tests/` by default;
`benchmarks/` for `bench serve`'s multi-turn client): what they import beyond them is
in the installed wheel. `fetch_vllm_tests.py [FOLDER...]` prints the path of each
unpacked folder. Knows nothing of what the tests or benchmarks do.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "0.32.0"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/d5/df/"
    "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/vllm-0.32.0.tar.gz"
)
# From https://pypi.org/simple/vllm/ (Accept: application/vnd.pypi.simple.v1+json).
SDIST_SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
ROOT_NAME = f"vllm-{VERSION}"
DOWNLOAD_TIMEOUT_S = 120
FOLDERS = ("tests", "benchmarks")


def cache_dir_from_env(environ: dict[str, str] | None = None) -> Path:
    """Where the sdist and its tests are kept: `$KVSPLICE_CACHE/vllm-0.32.0-sdist`."""
    environ = dict(os.environ) if environ is None else environ
    base = environ.get("KVSPLICE_CACHE") or "~/.cache/kvsplice"
    return Path(base).expanduser() / f"{ROOT_NAME}-sdist"


def fetch_tests(
    cache_dir: Path,
    url: str = SDIST_URL,
    sha256: str = SDIST_SHA256,
    folders: tuple[str, ...] = ("tests",),
) -> Path:
    """The unpacked sdist root (holding `folders`), downloading and unpacking what is missing.

    Raises ValueError, keeping nothing, when the download's sha256 is not `sha256`.
    """
    unknown = sorted(set(folders) - set(FOLDERS))
    if unknown or not folders:
        raise ValueError(f"folders {unknown} not in {FOLDERS}")
    root = cache_dir / ROOT_NAME
    stamp = root / ".sha256"
    current = stamp.is_file() and stamp.read_text().strip() == sha256
    missing = [f for f in folders if not (current and (root / f).is_dir())]
    if not missing:
        return root
    archive = _verified_archive(cache_dir, url, sha256)
    if not current:  # another sdist's folders, or a partial unpack: start afresh
        shutil.rmtree(root, ignore_errors=True)
    for folder in missing:
        _unpack_folder(archive, root, folder)
    stamp.write_text(sha256 + "\n")
    return root


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _verified_archive(cache_dir: Path, url: str, sha256: str) -> Path:
    """The cached sdist when its sha256 is `sha256`, else a fresh download that must be."""
    archive = cache_dir / f"{ROOT_NAME}.tar.gz"
    if archive.is_file() and sha256_of(archive) == sha256:
        return archive
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = archive.with_suffix(".partial")
    with (
        urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response,
        partial.open("wb") as file,
    ):
        shutil.copyfileobj(response, file, 1 << 20)
    actual = sha256_of(partial)
    if actual != sha256:
        partial.unlink()
        raise ValueError(f"{url} has sha256 {actual}, not the index's {sha256}")
    partial.replace(archive)
    return archive


def _unpack_folder(archive: Path, root: Path, folder: str) -> None:
    """Unpack `vllm-0.32.0/<folder>/` into `root`, replacing what was there only once complete."""
    prefix = f"{ROOT_NAME}/{folder}/"
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="unpack-", dir=root.parent))
    try:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            tar.extractall(staging, members=members, filter="data")
        shutil.rmtree(root / folder, ignore_errors=True)
        (staging / ROOT_NAME / folder).replace(root / folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # No `choices`: Python 3.11's argparse refuses an empty `nargs="*"` list with them.
    parser.add_argument("folders", nargs="*", help=f"any of {FOLDERS} (default: tests)")
    folders = tuple(parser.parse_args(argv).folders) or ("tests",)
    if not set(folders) <= set(FOLDERS):
        parser.error(f"folders {folders}: each must be one of {FOLDERS}")
    root = fetch_tests(cache_dir_from_env(), folders=folders)
    for folder in folders:
        print(root / folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
