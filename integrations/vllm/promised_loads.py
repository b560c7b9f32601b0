"""The loads the scheduler half promised: each as a `LoadSpec`, in the step or beside the steps.

`promise` turns a request's allocated blocks into a `LoadSpec` over the looked-up
segments (and approximate runs); it waits in `take` for the request's first scheduled
step, or, as an async load (vLLM's `load_kv_async`), goes out in `take_async` with the
step that promised it. `is_async` is the choice between the two (`load_async`: always,
never, or "auto": only while other requests run). Knows request ids, not vLLM's objects.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvsplice.common.keys import KeyChain
from kvsplice.common.reuse_modes import NAIVE
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.integrations.vllm.transfer_specs import LoadSpec, StoredPiece
from kvsplice.storeclient.results import PrefixLookup


class PromisedLoads:
    def __init__(self, block_size: int, load_async: str, faults: FaultLog) -> None:
        self.block_size = block_size
        self.load_async = load_async  # "auto", "always" or "never" (ConnectorConfig's)
        self.faults = faults
        self._pending: dict[str, LoadSpec] = {}  # request id -> its load, at its first step
        self._async: list[LoadSpec] = []  # promised this step, sent in its metadata
        self._running: set[str] = set()  # scheduled in the last step, not finished

    def is_async(self, request_id: str) -> bool:
        """Whether a load goes beside the steps: always, never, or ("auto") only while other
        requests run (an idle engine would only wait for the background load)."""
        if self.load_async == "auto":
            return bool(self._running - {request_id})
        return self.load_async == "always"

    def promise(
        self, request_id: str, namespace: str, root: str, lookup: PrefixLookup,
        token_ids: Sequence[int], block_ids: Sequence[int], start: int, end: int,
        spans: tuple[ReusedSpan, ...], *, is_async: bool, mode: str = NAIVE,
    ) -> LoadSpec:  # fmt: skip
        """Load tokens `[start, end)` into the request's blocks: the stored pieces up to the
        first run of `spans`, the runs from there.

        NOTE: once vLLM allocated for a promise, a LoadSpec must reach the worker even if
        building its pieces fails: a spec without pieces makes the worker report every
        promised block failed (recomputed), never leaves them unwritten.
        """
        exact_end = spans[0].start if spans else end
        try:
            pieces = _pieces(lookup, root, start, exact_end)
        except Exception as error:
            self.faults.record("building a load failed", error)
            pieces, spans = (), ()
        first, last = start // self.block_size, end // self.block_size
        checked_end = max([end, *(piece.start + piece.num_tokens for piece in pieces)])
        load = LoadSpec(
            request_id=request_id, namespace=namespace, root=root, start=start, end=end,
            block_ids=tuple(block_ids[first:last]), token_ids=tuple(token_ids[:checked_end]),
            pieces=pieces, is_async=is_async, spans=spans, mode=mode,
        )  # fmt: skip
        if is_async:  # NOTE: the request is not scheduled until its load ends
            self._async.append(load)
        else:
            self._pending[request_id] = load
        return load

    def take_async(self) -> list[LoadSpec]:
        """The async loads promised since the last step (vLLM holds their requests back)."""
        loads, self._async = self._async, []
        return loads

    def pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def take(self, request_id: str) -> LoadSpec | None:
        """The request's load, handed over once, in its first scheduled step."""
        return self._pending.pop(request_id, None)

    def ran(self, request_ids: set[str]) -> None:
        """The requests scheduled in this step (what "auto" asks about)."""
        self._running = request_ids

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._running.discard(request_id)


def _pieces(lookup: PrefixLookup, root: str, start: int, end: int) -> tuple[StoredPiece, ...]:
    """The looked-up segments overlapping `[start, end)`, each with its parent key."""
    chain = KeyChain(root)
    pieces = []
    for ref in lookup.segments:
        if ref.start_position < end and ref.end_position > start:
            pieces.append(
                StoredPiece(ref.segment_id, ref.start_position, ref.num_tokens, chain.parent)
            )
        chain.follow(ref.context_key, ref.num_tokens)
    return tuple(pieces)
