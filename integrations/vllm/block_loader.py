"""A promised load into the engine's blocks: stored pieces first, then the approximate runs.

Each piece is fetched and verified (`SegmentFetch.piece`) and only then written; any
fault marks the request's blocks from the first bad one on as failed (vLLM recomputes
them), taints them (`WorkerNewsDesk`) and deletes a piece that failed verification.
What each load served is reported to the sidecar once its request starts (`report`).
"""

from __future__ import annotations

from kvsplice.common.reuse_report import ReusedRun
from kvsplice.integrations.vllm.anchor_loads import GateRefused
from kvsplice.integrations.vllm.paged_caches import PagedCaches
from kvsplice.integrations.vllm.segment_fetch import LoadFault, SegmentFetch
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.span_writer import SpanWriter
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.integrations.vllm.transfer_specs import LoadFaultNews, LoadSpec, RequestStart
from kvsplice.integrations.vllm.worker_news import WorkerNewsDesk
from kvsplice.kvmath.fused_decode import stored_tensors


class BlockLoader:
    def __init__(
        self, clients: StoreClients, paged: PagedCaches, fetch: SegmentFetch, spans: SpanWriter,
        news: WorkerNewsDesk, faults: FaultLog,
    ) -> None:  # fmt: skip
        self.clients = clients
        self.paged = paged
        self.fetch = fetch
        self.spans = spans
        self.news = news
        self.faults = faults
        self.num_loaded_tokens = 0
        self.num_failed_loads = 0
        self.num_corrupt_loads = 0  # of the failed: a piece failed verification (deleted)
        self.num_missing_loads = 0  # of the failed: a promised segment was gone
        self._loaded_runs: dict[str, list[ReusedRun]] = {}  # request id -> this step's load

    def load(self, spec: LoadSpec) -> set[int]:
        """Write tokens `[spec.start, spec.end)`; returns the block ids that could not be loaded.

        Blocks before the first bad piece stay written; the rest are reported failed.
        """
        block_size = self.paged.block_size
        written = [0]  # blocks of spec.block_ids written so far
        try:
            fault = self._write(spec, written)
        except LoadFault as error:
            fault = error
        except Exception as error:  # a bug or an unexpected status: recompute the rest
            position = spec.start + written[0] * block_size
            fault = LoadFault(position, f"loading failed: {error!r}")
        num_good = written[0]
        if num_good:
            self.num_loaded_tokens += num_good * block_size
            self._loaded_runs[spec.request_id] = self._runs(
                spec, spec.start + num_good * block_size
            )
        if fault is None:
            return set()
        return self._failed(spec, num_good, fault)

    def _write(self, spec: LoadSpec, written: list[int]) -> LoadFault | None:
        """Fetch, verify and write each piece in turn, counting written blocks in `written[0]`;
        then the runs. Raises LoadFault at the first piece that cannot be used.

        Pieces go as views of the payload (`stored_tensors`: no decoded copy when it holds the
        cache's dtype) straight into the blocks, not through `decode_into`, whose `[L, H_kv, T,
        D]` out a run of paged blocks is not (one tensor per layer, blocks apart): a Δ of 0 needs
        no rotation, and a buffer would cost a second copy.
        """
        block_size = self.paged.block_size
        position = spec.start
        for piece in spec.pieces:
            stored = self.fetch.piece(spec, piece)
            keys, values = stored_tensors(stored, self.paged.dtype)  # each [L, H_kv, T, D]
            lo = position - piece.start
            hi = min(spec.end, piece.start + piece.num_tokens) - piece.start
            first, num_blocks = written[0], (hi - lo) // block_size  # all block-aligned
            blocks = spec.block_ids[first : first + num_blocks]
            self.paged.scatter(blocks, keys[:, :, lo:hi], values[:, :, lo:hi])
            written[0] = first + num_blocks
            position = piece.start + hi
        if spec.spans and position < spec.end:
            first, num_blocks = written[0], (spec.end - position) // block_size
            self.spans.write(spec, position, spec.block_ids[first : first + num_blocks])
            written[0] = first + num_blocks
            position = spec.end
        if position != spec.end:
            return LoadFault(position, f"the stored run ends at {position}, {spec.end} promised")
        return None

    def _failed(self, spec: LoadSpec, num_good: int, fault: LoadFault) -> set[int]:
        """Report the blocks from the first bad one on, taint them, tell the scheduler (a
        refusal of the anchor gate the same way, as a refusal: nothing failed)."""
        refusal = fault.refusal if isinstance(fault, GateRefused) else None
        if refusal is None:
            self.num_failed_loads += 1
            self.num_missing_loads += fault.missing
            self.faults.record("load failed", f"request {spec.request_id}: {fault}")
        if fault.corrupt_segment_id is not None:
            self.num_corrupt_loads += 1
            self._delete(spec.namespace, fault.corrupt_segment_id)
        failed = set(spec.block_ids[num_good:])
        position = spec.start + num_good * self.paged.block_size
        news = LoadFaultNews(
            spec.request_id, spec.namespace, position, fault.corrupt_segment_id, refusal
        )
        self.news.load_failed(news, failed)
        return failed

    def _delete(self, namespace: str, segment_id: str) -> None:
        """Remove a segment that failed verification (a reader's token may not: then the
        scheduler's own list keeps it from being promised)."""
        try:
            self.clients.for_namespace(namespace).delete(segment_id)
        except Exception as error:
            self.faults.record("deleting a corrupt segment failed", error)

    def report(self, start: RequestStart) -> None:
        """Tell the sidecar what this request reused (queued; sent by a background flush), so
        its stats count every token the engine loaded, and where it was served from."""
        runs = self._loaded_runs.pop(start.request_id, [])
        try:
            store = self.clients.for_namespace(start.namespace)
            store.report_reuse(start.num_prompt_tokens, runs)
        except Exception as error:
            self.faults.record("reporting reuse failed", error)

    def _runs(self, spec: LoadSpec, end: int) -> list[ReusedRun]:
        """The loaded tokens `[spec.start, end)` per stored piece or run read (each a read
        of its segment), with where each was read and whether it was exact."""
        store = self.clients.for_namespace(spec.namespace)
        runs = []
        for piece in spec.pieces:
            lo, hi = max(spec.start, piece.start), min(end, piece.start + piece.num_tokens)
            if lo < hi:
                key = bytes.fromhex(piece.segment_id)
                runs.append(ReusedRun(hi - lo, store.served_from(key), key))
        for span in spec.spans:  # approximate: computed at another position or prefix
            lo, hi = span.start, min(end, span.end)
            if lo < hi:
                key = bytes.fromhex(span.segment_id)
                runs.append(ReusedRun(hi - lo, store.served_from(key), key, exact=False))
        return runs
