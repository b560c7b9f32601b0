"""Reading a file in large chunks and hashing it: the one loop the model and engine digests share.

Owns neither the hash (callers pick xxh3 or sha256) nor what a digest is for.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

CHUNK_NBYTES = 1 << 24  # 16 MiB: few syscalls on multi-GiB weights, little memory


class Hasher(Protocol):
    """What `hashlib` and `xxhash` hashers have in common."""

    def update(self, data: bytes, /) -> None: ...

    def hexdigest(self) -> str: ...


def file_chunks(path: Path) -> Iterator[bytes]:
    """`path`'s bytes in order, `CHUNK_NBYTES` at a time (the file is closed when exhausted)."""
    with path.open("rb") as f:
        yield from iter(functools.partial(f.read, CHUNK_NBYTES), b"")


def file_hexdigest(path: Path, hasher: Hasher) -> str:
    """The hex digest of `path`'s bytes by `hasher` (a fresh one: it is fed the whole file)."""
    for chunk in file_chunks(path):
        hasher.update(chunk)
    return hasher.hexdigest()
