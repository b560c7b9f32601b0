"""`PayloadBuffer`: a put's payload with writable room before it in one buffer.

Owns the shape only: a receiver that has room before the payload (a staged put's private
mapping) lets the store write a record header there, so header and payload form one
contiguous value without copying the payload; a staged payload also names the file it
lies in (`StagedFile`), which a durable tier may adopt instead of copying it. Who
verifies the bytes is the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagedFile:
    """The file a staged payload lies in, at `offset` (checked: a regular file, long enough).
    `device` and `inode` name the file that was checked, so that one moved in by name
    can be told from another the writer put under that name since."""

    path: str
    device: int
    inode: int
    offset: int


@dataclass(frozen=True)
class PayloadBuffer:
    """The payload is `buffer[offset:]`; `buffer[:offset]` is scratch its holder may overwrite."""

    buffer: memoryview  # flat bytes, writable where offset > 0
    offset: int = 0
    staged: StagedFile | None = None  # the file `buffer` maps, for a staged put

    def __post_init__(self) -> None:
        if not 0 <= self.offset <= self.buffer.nbytes:
            raise ValueError(f"offset {self.offset} is outside a {self.buffer.nbytes}-byte buffer")

    @property
    def view(self) -> memoryview:
        return self.buffer[self.offset :]

    def __len__(self) -> int:
        return self.buffer.nbytes - self.offset
