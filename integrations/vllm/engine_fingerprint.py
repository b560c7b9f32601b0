"""The fingerprint of a model an engine serves, computed from its directory without loading it.

Architecture and RoPE come from `config.json`, the weights digest from the weight
files' bytes, the vocabulary digest from the tokenizer files, and the KV dtype is
the engine's. Digests of large weight files are cached by (path, size, mtime) so a
restart does not hash gigabytes again. Knows nothing of vLLM's objects or of torch.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import xxhash

from kvsplice.common.file_digest import file_hexdigest
from kvsplice.common.keys import (
    FingerprintParts,
    canonical_json,
    compute_fingerprint,
    derive_fingerprint,
)

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)
# Config keys that name the checkpoint's provenance or runtime switches, not the math.
VOLATILE_KEYS = frozenset(
    {"_name_or_path", "_model_name_or_path", "_commit_hash", "transformers_version",
     "use_cache", "architectures", "dtype", "torch_dtype"}
)  # fmt: skip
ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
             "max_position_embeddings", "head_dim")  # fmt: skip
DEFAULT_DIGEST_CACHE = Path("~/.cache/kvsplice/weight-digests.json")


def engine_fingerprint(
    model_dir: Path, kv_dtype: str, *, digest_cache: Path | None = DEFAULT_DIGEST_CACHE
) -> str:
    """`kvfp1-<hex>` of the model in `model_dir` whose K/V the engine keeps as `kv_dtype`.

    Two engines serving the same files with the same KV dtype agree; any change to
    the weights, the config, the tokenizer or the dtype gives another fingerprint.
    """
    config = json.loads((model_dir / "config.json").read_text())
    text_config = config.get("text_config", config)
    parts = FingerprintParts(
        architecture=_stripped(config),
        rope={k: text_config[k] for k in ROPE_KEYS if k in text_config},
        weights_digest=weights_digest(model_dir, digest_cache),
        vocab_digest=_files_digest(model_dir, TOKENIZER_FILES) or "no-tokenizer-files",
        kv_dtype=f"engine:{kv_dtype}",
    )
    return compute_fingerprint(parts)


def effective_fingerprint(files_fingerprint: str, settings: dict[str, Any]) -> str:
    """The fingerprint of what the engine really computes: the files' fingerprint with the
    engine's own settings that change K/V folded in (online quantization, config overrides,
    the RoPE it resolved). Two engines with the same files and settings agree."""
    return derive_fingerprint(files_fingerprint, {"engine": settings})


def weights_digest(model_dir: Path, digest_cache: Path | None) -> str:
    """xxh3-128 over (name, bytes) of every weight file in `model_dir`, sorted by name."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not files:
        raise FileNotFoundError(f"no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {model_dir}")
    cache = _DigestCache(digest_cache)
    hasher = xxhash.xxh3_128()
    for path in files:
        hasher.update(canonical_json([path.name, cache.digest(path)]).encode())
    cache.save()
    return hasher.hexdigest()


def _stripped(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stripped(v) for k, v in value.items() if k not in VOLATILE_KEYS}
    return value


def _files_digest(model_dir: Path, names: tuple[str, ...]) -> str:
    hasher = xxhash.xxh3_128()
    found = False
    for name in names:
        path = model_dir / name
        if path.is_file():
            found = True
            hasher.update(name.encode())
            hasher.update(_file_digest(path).encode())
    return hasher.hexdigest() if found else ""


def _file_digest(path: Path) -> str:
    return file_hexdigest(path, xxhash.xxh3_128())


class _DigestCache:
    """File digests by (real path, size, mtime_ns), kept in one JSON file (None: in memory)."""

    def __init__(self, path: Path | None) -> None:
        self.path = None if path is None else path.expanduser()
        self.entries: dict[str, str] = {}
        self.changed = False
        if self.path is not None and self.path.is_file():
            try:
                self.entries = dict(json.loads(self.path.read_text()))
            except (OSError, ValueError) as error:  # a damaged cache only costs a rehash
                logger.warning("ignoring the weight digest cache %s: %s", self.path, error)

    def digest(self, path: Path) -> str:
        stat = path.stat()
        key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        if key not in self.entries:
            logger.info(
                "hashing %s (%d MiB) for the model fingerprint", path.name, stat.st_size >> 20
            )
            self.entries[key] = _file_digest(path)
            self.changed = True
        return self.entries[key]

    def save(self) -> None:
        if self.path is None or not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.entries, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as error:  # read-only home: hash again next start
            logger.warning("cannot write the weight digest cache %s: %s", self.path, error)
