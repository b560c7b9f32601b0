"""scripts/fetch_vllm_tests.py against a local sdist (a file:// URL): what it keeps, and
that a download whose sha256 is not the expected one is refused."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from types import ModuleType

import pytest
from helpers.scripts import load_script


@pytest.fixture(scope="module")
def fetch() -> ModuleType:
    return load_script("fetch_vllm_tests")


def make_sdist(path: Path, root_name: str, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{root_name}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def sdist(tmp_path: Path, fetch: ModuleType) -> Path:
    files = {"tests/v1/unit/utils.py": b"X = 1\n", "vllm/__init__.py": b"", "setup.py": b""}
    return make_sdist(tmp_path / "served.tar.gz", fetch.ROOT_NAME, files)


def fetched(fetch: ModuleType, sdist: Path, cache: Path) -> tuple[Path, str]:
    """The tests of `sdist` fetched into `cache` (its sha256 the expected one), and that sha256."""
    sha256 = fetch.sha256_of(sdist)
    return fetch.fetch_tests(cache, url=sdist.as_uri(), sha256=sha256), sha256


def test_unpacks_only_the_tests_and_reuses_them(
    tmp_path: Path, fetch: ModuleType, sdist: Path
) -> None:
    cache = tmp_path / "cache"
    root, sha256 = fetched(fetch, sdist, cache)
    assert (root / "tests/v1/unit/utils.py").read_bytes() == b"X = 1\n"
    assert sorted(p.name for p in root.iterdir()) == [".sha256", "tests"]
    sdist.unlink()  # a second call neither downloads nor unpacks
    assert fetch.fetch_tests(cache, url=sdist.as_uri(), sha256=sha256) == root


def test_a_cached_archive_is_unpacked_again_without_downloading(
    tmp_path: Path, fetch: ModuleType, sdist: Path
) -> None:
    cache = tmp_path / "cache"
    root, sha256 = fetched(fetch, sdist, cache)
    (root / ".sha256").unlink()
    sdist.unlink()
    assert fetch.fetch_tests(cache, url=sdist.as_uri(), sha256=sha256) == root
    assert (root / "tests/v1/unit/utils.py").is_file()


def test_refuses_a_download_whose_sha256_differs(
    tmp_path: Path, fetch: ModuleType, sdist: Path
) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="sha256"):
        fetch.fetch_tests(cache, url=sdist.as_uri(), sha256="0" * 64)
    assert sorted(p.name for p in cache.iterdir()) == []


def test_unpacks_the_benchmarks_beside_the_tests_without_downloading_again(
    tmp_path: Path, fetch: ModuleType
) -> None:
    files = {"tests/a.py": b"A = 1\n", "benchmarks/multi_turn/b.py": b"B = 2\n"}
    sdist = make_sdist(tmp_path / "served.tar.gz", fetch.ROOT_NAME, files)
    cache = tmp_path / "cache"
    root, sha256 = fetched(fetch, sdist, cache)
    (root / "tests/kept.txt").write_text("unpacked once")
    sdist.unlink()  # the cached archive serves the second folder
    assert fetch.fetch_tests(cache, sdist.as_uri(), sha256, ("benchmarks", "tests")) == root
    assert (root / "benchmarks/multi_turn/b.py").read_bytes() == b"B = 2\n"
    assert (root / "tests/kept.txt").is_file()
    assert sorted(p.name for p in root.iterdir()) == [".sha256", "benchmarks", "tests"]


def test_refuses_a_folder_it_does_not_know(tmp_path: Path, fetch: ModuleType) -> None:
    with pytest.raises(ValueError, match="vllm"):
        fetch.fetch_tests(tmp_path, folders=("vllm",))
