"""What a LoRA adapter is for the K/V it changes: a digest of its files' bytes.

vLLM names an adapter by a name and a path; neither says which weights are there (an
adapter replaced in place keeps both), so requests share K/V under an adapter only if
its files hash the same. Each file's digest is cached by (real path, size, mtime_ns):
a request stats the files, it does not read them. Knows directories, not vLLM.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import xxhash

from kvsplice.common.file_digest import file_hexdigest
from kvsplice.common.keys import canonical_json

logger = logging.getLogger(__name__)


class AdapterDigests:
    """`digest(path)`: xxh3-128 over (name, bytes) of every file in an adapter's directory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file_digests: dict[tuple[str, int, int], str] = {}
        self.num_hashed_files = 0  # files read (not served from the cache)
        self._refused: set[str] = set()  # paths warned about

    def digest(self, adapter_path: str) -> str | None:
        """The digest of the adapter's files; None if `adapter_path` is not a local directory
        of files (its K/V is then never shared)."""
        directory = Path(adapter_path).expanduser()
        files = []
        if directory.is_dir():
            files = sorted(p for p in directory.iterdir() if p.is_file())
        if not files:
            self._refuse(adapter_path)
            return None
        hasher = xxhash.xxh3_128()
        for path in files:
            hasher.update(canonical_json([path.name, self._file_digest(path)]).encode())
        return hasher.hexdigest()

    def _refuse(self, adapter_path: str) -> None:
        with self._lock:
            first = adapter_path not in self._refused
            self._refused.add(adapter_path)
        if first:
            logger.warning(
                "LoRA adapter %r is not a local directory of files: its requests' K/V is "
                "neither looked up nor saved", adapter_path,
            )  # fmt: skip

    def _file_digest(self, path: Path) -> str:
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        with self._lock:
            known = self._file_digests.get(key)
        if known is not None:
            return known
        logger.info("hashing the LoRA adapter file %s (%d KiB)", path, stat.st_size >> 10)
        digest = file_hexdigest(path, xxhash.xxh3_128())
        with self._lock:
            self._file_digests[key] = digest
            self.num_hashed_files += 1
        return digest


ADAPTER_DIGESTS = AdapterDigests()  # one per process: the scheduler's requests share it
