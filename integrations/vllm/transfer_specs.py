"""What the two halves tell each other: blocks to load and chunks to save (scheduler to
worker, each step), what became of them (worker to scheduler, `WorkerNews`).

Plain picklable records (vLLM may ship them between processes); no tensors, no vLLM types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsplice.integrations.vllm.span_cover import ReusedSpan


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
    `token_ids` are the request's tokens `[0, end)` and on to the last piece's end (each
    piece's tokens are checked against them, whole, before a single value is written: a
    promise may end inside its last piece). `is_async`: the request waits
    (vLLM's `load_kv_async`) while the load runs beside the engine's steps. `spans`
    (approximate reuse, requests that opted in): runs of segments computed elsewhere,
    from where `pieces` end to `end`, keys moved to their new positions.
    """

    request_id: str
    namespace: str
    root: str  # the fingerprint the request's chain hangs from (request_keys)
    start: int
    end: int
    block_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    pieces: tuple[StoredPiece, ...]
    is_async: bool = False
    spans: tuple[ReusedSpan, ...] = ()


@dataclass(frozen=True)
class SaveSpec:
    """Store tokens `[start, end)` (one chunk, whole blocks) as the next link of a chain.

    `block_table` is the request's block table (at least the blocks holding `[0, end)`;
    one tuple shared by all of a request's saves in a step): the chunk's K/V was computed
    over `context_block_ids`, so it is dropped if any of them failed to load. `exact`: its
    chain was still exact (`KeyChain.exact`); False past an approximate fence, where the
    chunk was computed over approximate K/V (stored as `SegmentMeta.exact`).
    """

    request_id: str
    namespace: str
    root: str
    start: int
    token_ids: tuple[int, ...]  # the chunk's tokens
    parent_key: bytes
    key: bytes  # the chunk's context key (its chain link)
    block_table: tuple[int, ...]
    block_size: int
    exact: bool
    session_id: str = ""  # the agent session the chunk is held for (empty: none)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def block_ids(self) -> tuple[int, ...]:
        return self.block_table[self.start // self.block_size : self.end // self.block_size]

    @property
    def context_block_ids(self) -> tuple[int, ...]:
        return self.block_table[: self.end // self.block_size]


@dataclass(frozen=True)
class RequestStart:
    """A request scheduled for the first time: the worker reports its reuse to the sidecar
    (prompt tokens, and what its load, if any, served) once the load is done."""

    request_id: str
    namespace: str
    num_prompt_tokens: int


@dataclass(frozen=True)
class LoadFaultNews:
    """A load failed at `position`: nothing computed over it may be stored, and a stored
    piece that failed verification (`corrupt_segment_id`) is not promised again."""

    request_id: str
    namespace: str
    position: int
    corrupt_segment_id: str | None = None


@dataclass
class WorkerNews:
    """What the worker learned since the last step: puts the sidecar acknowledged (or
    that failed, were dropped or withheld), load faults, and whether it can work at all."""

    acked: list[tuple[str, bytes]] = field(default_factory=list)  # (namespace, key)
    failed: list[tuple[str, bytes]] = field(default_factory=list)
    faults: list[LoadFaultNews] = field(default_factory=list)
    disabled: str | None = None  # why this worker cannot load or save (None: it can)

    def merge(self, other: WorkerNews) -> WorkerNews:
        return WorkerNews(
            self.acked + other.acked,
            self.failed + other.failed,
            self.faults + other.faults,
            self.disabled or other.disabled,
        )

    def __bool__(self) -> bool:
        return bool(self.acked or self.failed or self.faults or self.disabled)
