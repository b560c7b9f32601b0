"""Where a packaged model's converted (safetensors) copy lies in the model cache, and whether it is whole.

Owns the cache directory's naming and its completeness test; converting is `models`'. A
pinned model's copy is named by its sha256, so it is found without any of its packages: they
are needed only to convert. Importable without torch.
"""

from __future__ import annotations

from pathlib import Path

import xxhash

from kvsplice.client.model.packaged_models import ModelNotInstalledError, PackagedModel
from kvsplice.common.file_digest import file_hexdigest

# What `save_pretrained` of a model and its tokenizer always writes: a directory holding all of
# them was published whole (`models._publish` renames a finished temp directory into place).
WEIGHTS_FILES = ("model.safetensors", "model.safetensors.index.json")
REQUIRED_FILES = ("config.json", "tokenizer_config.json")


def converted_dir(packaged: PackagedModel, cache_dir: Path) -> Path:
    """The directory `packaged`'s converted copy has (or will have) in `cache_dir`.

    Named by the pinned sha256 of its GGUF, else by a digest of its one GGUF file, so a changed
    file converts again instead of reusing a stale copy; that digest needs the file's package
    (`ModelNotInstalledError` otherwise).
    """
    if packaged.sha256 is not None:
        return cache_dir / f"{packaged.slug}-{packaged.sha256[:16]}"
    gguf = packaged.part_paths()[0]
    return cache_dir / f"{packaged.slug}-{file_hexdigest(gguf, xxhash.xxh3_64())}"


def is_converted(directory: Path) -> bool:
    """Whether `directory` holds a whole converted model: config, tokenizer and weights."""
    return all((directory / name).is_file() for name in REQUIRED_FILES) and any(
        (directory / name).is_file() for name in WEIGHTS_FILES
    )


def cached_model_dir(packaged: PackagedModel, cache_dir: Path) -> Path | None:
    """`packaged`'s whole converted copy in `cache_dir`, else None (not converted yet, or an
    unpinned model whose package, which names its copy, is not installed)."""
    try:
        target = converted_dir(packaged, cache_dir)
    except ModelNotInstalledError:
        return None
    return target if is_converted(target) else None
