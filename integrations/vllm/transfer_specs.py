"""What the scheduler side tells the worker side each step: blocks to load, chunks to save.

Plain picklable records (vLLM may ship them to worker processes); no tensors, no vLLM types.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoredPiece:
    """A stored segment of the promised run: tokens `[start, start + num_tokens)`."""

    segment_id: str
    start: int
    num_tokens: int
    parent_key: bytes


@dataclass(frozen=True)
class LoadSpec:
    """Load tokens `[start, end)` of a request (whole blocks) from `pieces` into `block_ids`.

    `block_ids` are the request's blocks covering `[start, end)`, in order;
    `token_ids` are the request's tokens `[0, end)` (each piece's tokens are checked
    against them before a single value is written).
    """

    request_id: str
    namespace: str
    start: int
    end: int
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    pieces: tuple[StoredPiece, ...]


@dataclass(frozen=True)
class SaveSpec:
    """Store tokens `[start, end)` (one chunk, whole blocks) as the next link of a chain."""

    request_id: str
    namespace: str
    start: int
    token_ids: tuple[int, ...]  # the chunk's tokens
    parent_key: bytes
    block_ids: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class RequestStart:
    """A request scheduled for the first time: the worker reports its reuse to the sidecar
    (prompt tokens, and what its load, if any, served) once the load is done."""

    request_id: str
    namespace: str
    num_prompt_tokens: int
