"""The connector's scheduler half: what the sidecar holds for a request, and what to save.

`num_new_matched_tokens` looks the request's tokens up off the scheduler loop
(`Lookups`: None until the sidecar answered) and promises the block-aligned stored
run, never past a segment a worker found corrupt. `build_step` turns this step's
allocations into `LoadSpec`s, and every chunk of computed tokens the sidecar does
not hold into a `SaveSpec`. `absorb` takes the workers' news: acknowledged and
failed puts (a chunk counts as stored only once acknowledged; a failed one is put
again when next computed) and load faults (the request's chain rewinds to the
fault). Exact prefixes are promised to every request; a request that opted into
approximate reuse (`reuse_request`) on an engine whose admission policy admits it also
gets runs of stored segments computed elsewhere past its exact prefix (`span_search`),
fenced: from its first approximate token on, its chunks are saved off-chain (no exact
lookup reaches them; later opted-in requests find them by content), and vLLM's prefix
cache never serves those blocks to another request (`_fence`). Knows vLLM's request and
scheduler-output objects only through the few attributes it reads.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsplice.client.store.store_types import PrefixLookup
from kvsplice.common.errors import StoreUnavailable
from kvsplice.common.keys import ChainLink, KeyChain
from kvsplice.integrations.vllm.connector_config import salted_namespace
from kvsplice.integrations.vllm.gated_report import GatedOutcome, reason
from kvsplice.integrations.vllm.lookups import Found, LookupQuery, Lookups
from kvsplice.integrations.vllm.request_keys import request_root
from kvsplice.integrations.vllm.reuse_request import KEY, RequestedReuse, requested_reuse
from kvsplice.integrations.vllm.sidecar_faults import Breaker, FaultLog
from kvsplice.integrations.vllm.span_cover import ReusedSpan, trimmed
from kvsplice.integrations.vllm.span_search import SPAN_SEARCH_SHARE, find_spans
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.integrations.vllm.transfer_specs import (
    LoadSpec,
    RequestStart,
    SaveSpec,
    StoredPiece,
    WorkerNews,
)

logger = logging.getLogger(__name__)

# Chunks acknowledged recently (a system prompt shared by many requests is sent once).
MAX_RECENT_KEYS = 65_536
# A save never acknowledged nor failed (a worker gone) stops blocking others after this.
IN_FLIGHT_TTL_S = 120.0
# Segments a worker found corrupt are not promised for this long (deleted meanwhile).
BAD_SEGMENT_TTL_S = 600.0
# A request that waited this long since its lookup is looked up again before a load.
LOOKUP_MAX_AGE_S = 10.0


@dataclass
class _Tracked:
    """One request from its first lookup until it finishes."""

    request: Any  # vllm.v1.request.Request
    namespace: str
    root: str | None  # None: its K/V is never shared (request_keys)
    chain: KeyChain | None
    lookup: PrefixLookup | None = None  # None: not answered yet
    num_lookup_tokens: int = 0
    looked_up_s: float = 0.0
    ack_seq: int = 0  # acknowledgements seen when the lookup answered
    block_ids: list[int] = field(default_factory=list)
    held_keys: frozenset[bytes] = frozenset()
    pending_load: LoadSpec | None = None
    tail_saved_at: int = -1  # the chain position whose half-chunk tail this request saved
    load_async: bool = False  # its promised load goes beside the steps (vLLM's load_kv_async)
    num_local_tokens: int = 0  # computed or cached in the engine when the load was promised
    reuse: RequestedReuse = field(default_factory=RequestedReuse)
    spans: tuple[ReusedSpan, ...] = ()  # approximate runs past the exact prefix (looked up)
    promised_spans: tuple[ReusedSpan, ...] = ()  # those of the last promise
    approximate_from: int | None = None  # first token whose K/V may be approximate
    num_exact_tokens: int = 0  # loaded from exact chain links (the last load)
    num_approximate_tokens: int = 0  # loaded from runs computed elsewhere (the last load)
    num_promised_runs: int = 0  # approximate runs the last promise loads
    load_failed: bool = False  # a load of it failed (the worker's news)


class SchedulerSide:
    def __init__(
        self,
        clients: StoreClients,
        fingerprint: str,
        block_size: int,
        chunk_tokens: int,
        save_decode: bool = False,
        *,
        save_tails: bool = True,
        load_async: str = "never",
        lookup_wait_s: float = 0.02,
        lookup_timeout_s: float = 2.0,
        breaker: Breaker | None = None,
        faults: FaultLog | None = None,
        approximate: bool = False,
        hash_block_size: int | None = None,
    ) -> None:
        self.clients = clients
        # whether the admission policy admits approximate runs for requests that opt in
        self.approximate = approximate
        self.hash_block_size = hash_block_size or block_size  # vLLM's prefix-cache hashes
        self.save_decode = save_decode
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        # a half chunk in whole blocks (0: chunks too small for a tail)
        self.tail_tokens = chunk_tokens // 2 // block_size * block_size if save_tails else 0
        self.load_async = load_async  # "auto", "always" or "never" (ConnectorConfig's)
        self._async_loads: list[LoadSpec] = []  # promised this step, sent in its metadata
        self._running: set[str] = set()  # scheduled in the last step, not finished
        self.faults = faults or FaultLog()
        self.lookups = Lookups(
            self._lookup, wait_s=lookup_wait_s, timeout_s=lookup_timeout_s,
            breaker=breaker or Breaker(), faults=self.faults,
        )  # fmt: skip
        self._tracked: dict[str, _Tracked] = {}
        self._in_flight: dict[tuple[str, bytes], float] = {}
        self._acked: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._ack_seq = 0
        self._bad_segments: dict[str, float] = {}
        self.disabled: str | None = None
        self.num_hit_tokens = 0
        self.num_promised_exact_tokens = 0  # of num_hit_tokens: from exact chain links
        self.num_promised_approximate_tokens = 0  # and from approximate runs
        self.num_faults_seen = 0  # load faults absorbed: the worker withholds saves until then

    @property
    def num_lookups(self) -> int:
        return self.lookups.num_lookups

    # ---- lookups -------------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens past `num_computed_tokens` the sidecar holds, whole blocks, leaving one to
        compute; None while the lookup is under way (vLLM asks again next step)."""
        tracked = self._track(request)
        tracked.num_local_tokens = num_computed_tokens
        cap = (len(request.all_token_ids) - 1) // self.block_size * self.block_size
        if self.disabled or tracked.root is None or cap <= num_computed_tokens:
            return 0  # nothing the sidecar could add: no lookup
        if tracked.lookup is None or _stale(tracked, len(request.all_token_ids)):
            query = LookupQuery(
                tracked.namespace, tracked.root, len(request.all_token_ids),
                approximate=self._wants_spans(tracked),
            )  # fmt: skip
            found = self.lookups.poll(request.request_id, query, request.all_token_ids)
            if found is None:
                return None
            self._answered(tracked, self._without_bad(found.exact), query.num_tokens)
            tracked.spans = self._spans_without_bad(found.spans)
        assert tracked.lookup is not None
        aligned = min(tracked.lookup.num_matched_tokens, cap) // self.block_size * self.block_size
        end = max(aligned, num_computed_tokens)
        tracked.promised_spans = ()
        if tracked.spans and tracked.spans[0].start == tracked.lookup.num_matched_tokens:
            approximate_end = min(tracked.spans[-1].end, cap) // self.block_size * self.block_size
            if approximate_end > end:
                tracked.promised_spans = trimmed(tracked.spans, end, approximate_end)
                self._fence(tracked, end)
                end = approximate_end
        num_tokens = max(0, end - num_computed_tokens)
        tracked.load_async = num_tokens > 0 and self._loads_async(request.request_id)
        return num_tokens

    def _wants_spans(self, tracked: _Tracked) -> bool:
        return self.approximate and tracked.reuse.approximate and tracked.root is not None

    def _fence(self, tracked: _Tracked, position: int) -> None:
        """From `position` on the request's K/V may be approximate: saved only off-chain
        (`_leave_exact_at_fence`), and never found in vLLM's prefix cache by another request.

        NOTE: vLLM caches a request's blocks under `request.block_hashes` (chained: each
        covers the whole prefix before it) right after this promise is allocated. The
        hashes from `position` on are replaced by random ones, so no later request can
        hash to them; the hashes vLLM appends later chain from these, so they are unique
        too. Blocks before `position` keep their hashes: their K/V is exact.
        """
        first = position // self.hash_block_size
        hashes = getattr(tracked.request, "block_hashes", None)
        if hashes is not None:
            for i in range(first, len(hashes)):
                hashes[i] = os.urandom(32)
        if tracked.approximate_from is None or position < tracked.approximate_from:
            tracked.approximate_from = position

    def is_async_load(self, request: Any) -> bool:
        """Whether the load `num_new_matched_tokens` just promised goes beside the steps."""
        tracked = self._tracked.get(request.request_id)
        return tracked is not None and tracked.load_async

    def _loads_async(self, request_id: str) -> bool:
        """Whether a load goes beside the steps: always, never, or ("auto") only while other
        requests run (an idle engine would only wait for the background load)."""
        if self.load_async == "auto":
            return bool(self._running - {request_id})
        return self.load_async == "always"

    def _lookup(self, query: LookupQuery, token_ids: Sequence[int]) -> Found:
        """One `LookupPrefix` (on a lookup thread); a degraded call is a fault, not a miss.
        With `query.approximate`, the runs that continue the prefix too."""
        deadline = time.monotonic() + self.lookups.timeout_s * SPAN_SEARCH_SHARE
        store = self.clients.for_namespace(query.namespace)
        degraded = store.counters.num_degraded_calls
        lookup = store.lookup_prefix(query.root, token_ids)
        if store.counters.num_degraded_calls != degraded:
            raise StoreUnavailable("the sidecar did not answer LookupPrefix in time")
        if not query.approximate:
            return Found(lookup)
        try:
            spans = find_spans(
                store, query.root, token_ids, lookup.num_matched_tokens,
                block_size=self.block_size, chunk_tokens=self.chunk_tokens,
                deadline=deadline, faults=self.faults,
            )  # fmt: skip
        except Exception as error:  # the exact prefix stands
            self.faults.record("looking up approximate runs failed", error)
            spans = ()
        return Found(lookup, spans)

    def _answered(self, tracked: _Tracked, lookup: PrefixLookup, num_tokens: int) -> None:
        """Keep the lookup; what it found counts as stored for requests that are not looked
        up (their local hit covers all the sidecar could add) and would put it again."""
        tracked.held_keys = frozenset(ref.context_key for ref in lookup.segments)
        if tracked.held_keys:
            self._ack_seq += 1
            self._remember_acked((tracked.namespace, key) for key in tracked.held_keys)
        tracked.lookup, tracked.num_lookup_tokens = lookup, num_tokens
        tracked.looked_up_s, tracked.ack_seq = time.monotonic(), self._ack_seq

    def _remember_acked(self, keys: Iterable[tuple[str, bytes]]) -> None:
        for key in keys:
            self._acked[key] = self._ack_seq
            self._acked.move_to_end(key)
        while len(self._acked) > MAX_RECENT_KEYS:
            self._acked.popitem(last=False)

    def _spans_without_bad(self, spans: tuple[ReusedSpan, ...]) -> tuple[ReusedSpan, ...]:
        """`spans` cut before the first run from a segment a worker found corrupt."""
        for i, span in enumerate(spans):
            if span.segment_id in self._bad_segments:
                return spans[:i]
        return spans

    def _without_bad(self, lookup: PrefixLookup) -> PrefixLookup:
        """`lookup` cut before the first segment a worker found corrupt."""
        if not self._bad_segments:
            return lookup
        now = time.monotonic()
        self._bad_segments = {s: t for s, t in self._bad_segments.items() if t > now}
        for i, ref in enumerate(lookup.segments):
            if ref.segment_id in self._bad_segments:
                kept = lookup.segments[:i]
                return PrefixLookup(kept, kept[-1].end_position if kept else 0)
        return lookup

    # ---- allocation and steps ------------------------------------------------------------

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Remember where the promised tokens go; a load is built for the next step.

        NOTE: once vLLM allocated for a promise, a LoadSpec must reach the worker even if
        building its pieces fails: a spec without pieces makes the worker report every
        promised block failed (recomputed), never leaves them unwritten.
        """
        tracked = self._tracked.get(request.request_id)
        if tracked is None or num_external_tokens <= 0:
            return
        start = tracked.num_local_tokens
        end = start + num_external_tokens
        first, last = start // self.block_size, end // self.block_size
        spans = trimmed(tracked.promised_spans, start, end)
        exact_end = spans[0].start if spans else end
        try:
            pieces = _pieces(
                tracked.lookup or PrefixLookup.MISS, tracked.root or "", start, exact_end
            )
        except Exception as error:
            self.faults.record("building a load failed", error)
            pieces, spans = (), ()
        load = LoadSpec(
            request_id=request.request_id, namespace=tracked.namespace,
            root=tracked.root or "", start=start, end=end,
            block_ids=tuple(block_ids[first:last]),
            token_ids=tuple(tracked.request.all_token_ids[:end]), pieces=pieces,
            is_async=tracked.load_async, spans=spans,
        )  # fmt: skip
        tracked.num_exact_tokens = exact_end - start
        tracked.num_approximate_tokens = end - exact_end
        tracked.num_promised_runs = len(spans)
        self.num_promised_exact_tokens += tracked.num_exact_tokens
        self.num_promised_approximate_tokens += tracked.num_approximate_tokens
        if tracked.load_async:  # NOTE: the request is not scheduled until its load ends
            self._async_loads.append(load)
        else:
            tracked.pending_load = load
        self.num_hit_tokens += num_external_tokens

    def build_step(
        self, scheduler_output: Any
    ) -> tuple[list[LoadSpec], list[SaveSpec], list[RequestStart]]:
        self.lookups.new_step()
        loads, self._async_loads = self._async_loads, []
        starts: list[RequestStart] = []
        computed: list[tuple[_Tracked, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            starts.append(
                RequestStart(new.req_id, tracked.namespace, tracked.request.num_prompt_tokens)
            )
            tracked.block_ids = list(new.block_ids[0])
            self._take_load(tracked, loads)
            scheduled = scheduler_output.num_scheduled_tokens[new.req_id]
            computed.append((tracked, new.num_computed_tokens + scheduled))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted: all its blocks are new
                tracked.block_ids = [] if new_blocks is None else list(new_blocks[0])
                if tracked.pending_load is not None:  # its hits are reported too
                    starts.append(RequestStart(req_id, tracked.namespace, 0))
            elif new_blocks is not None:
                tracked.block_ids.extend(new_blocks[0])
            self._take_load(tracked, loads)
            scheduled = scheduler_output.num_scheduled_tokens[req_id]
            computed.append((tracked, cached.num_computed_tokens[i] + scheduled))
        self._running = {tracked.request.request_id for tracked, _ in computed}
        return loads, self._all_saves(computed, scheduler_output), starts

    def finished(self, request: Any) -> dict[str, Any] | None:
        """Forget the request; for one that asked for a reuse mode, what it got (returned
        to the client in the response's `kv_transfer_params`)."""
        tracked = self._tracked.pop(request.request_id, None)
        self._running.discard(request.request_id)
        self.lookups.forget(request.request_id)
        if tracked is None or not _asked(request):
            return None
        report: dict[str, Any] = {
            "reuse": tracked.reuse.mode,
            "admitted": self._wants_spans(tracked),
            "exact_tokens": tracked.num_exact_tokens,
            "approximate_tokens": tracked.num_approximate_tokens,
        }
        if tracked.reuse.problem:
            report["problem"] = tracked.reuse.problem
        if tracked.reuse.approximate:
            why = reason(_outcome(tracked, self._wants_spans(tracked)))
            if why is not None:
                report["reason"] = why
        return {KEY: report}

    # ---- what the workers report ---------------------------------------------------------

    def absorb(self, news: WorkerNews) -> None:
        """Acknowledged puts count as stored; failed ones are free to be put again; a load
        fault rewinds its request's chain and keeps a corrupt segment from being promised."""
        if news.acked:
            self._ack_seq += 1
            for key in news.acked:
                self._in_flight.pop(key, None)
            self._remember_acked(news.acked)
        for key in news.failed:
            self._in_flight.pop(key, None)
        for fault in news.faults:
            self.num_faults_seen += 1
            if fault.corrupt_segment_id is not None:
                self._bad_segments[fault.corrupt_segment_id] = time.monotonic() + BAD_SEGMENT_TTL_S
            tracked = self._tracked.get(fault.request_id)
            if tracked is not None:
                tracked.load_failed = True
                self._rewind(tracked, fault.position)
        if news.disabled and not self.disabled:
            self.disabled = news.disabled
            logger.error("kvsplice connector off (nothing promised): %s", news.disabled)

    def _rewind(self, tracked: _Tracked, position: int) -> None:
        """Move the request's save chain back to `position` (a chunk edge or earlier):
        vLLM recomputes from there, and those chunks are saved once computed again."""
        if tracked.chain is None or tracked.root is None:
            return
        target = min(tracked.chain.position, position // self.chunk_tokens * self.chunk_tokens)
        chain = KeyChain(tracked.root)
        tokens = tracked.request.all_token_ids
        while chain.position < target:
            _leave_exact_at_fence(tracked, chain, chain.position + self.chunk_tokens)
            chain.extend(tokens[chain.position : chain.position + self.chunk_tokens])
        tracked.chain = chain
        tracked.held_keys = frozenset()
        tracked.tail_saved_at = -1

    # ---- saves ---------------------------------------------------------------------------

    def _all_saves(
        self, computed: list[tuple[_Tracked, int]], scheduler_output: Any
    ) -> list[SaveSpec]:
        saves: list[SaveSpec] = []
        self._expire_in_flight()
        for tracked, num_computed in computed:
            try:
                saves.extend(self._saves(tracked, num_computed, scheduler_output))
            except Exception as error:  # a save not made is a future miss
                self.faults.record("planning saves failed", error)
        return saves

    def _saves(self, tracked: _Tracked, num_computed: int, scheduler_output: Any) -> list[SaveSpec]:
        """Chunks whose K/V exists after this step and whose tokens are known, not yet stored.

        Draft tokens of speculative decoding may be rejected: their K/V is never saved.
        NOTE: by default only prompt positions are saved. K/V the engine wrote one token at
        a time while decoding differs in its last bits from what a prefill of the same
        tokens writes (other kernels), and in bf16 that is enough to change a later greedy
        token; a transcript's next agent prefills those answer tokens and stores them then.
        `save_decode` stores them at once (more reuse, outputs then match a recompute only
        up to that rounding, as with vLLM's own prefix cache).

        A chunk reaching past the request's first approximate token (`approximate_from`)
        was computed over approximate K/V: from there the chain goes off-chain for good
        (`common.keys.off_chain_key`), so no exact lookup ever returns it, while a later
        request that opted in finds it by content (the next agent of a persona-first
        pipeline then finds the quoting text and the answers this request computed).
        Before leaving, the exact part gets its half-chunk tail if it has one.
        """
        chain = tracked.chain
        if chain is None or tracked.root is None or self.disabled:
            return []
        request_id = tracked.request.request_id
        num_draft = len(scheduler_output.scheduled_spec_decode_tokens.get(request_id, ()))
        token_ids = tracked.request.all_token_ids
        ready = min(
            num_computed - num_draft, len(token_ids), len(tracked.block_ids) * self.block_size
        )
        if not self.save_decode:
            ready = min(ready, tracked.request.num_prompt_tokens)
        saves: list[SaveSpec] = []
        table: tuple[int, ...] | None = None  # built once, shared by this step's saves
        while chain.position + self.chunk_tokens <= ready:
            fence = tracked.approximate_from
            if chain.exact and fence is not None and chain.position + self.chunk_tokens > fence:
                exact_tail = self._tail(tracked, min(ready, fence))
                if exact_tail is not None:
                    table = tuple(tracked.block_ids) if table is None else table
                    saves.append(self._save_spec(tracked, exact_tail, token_ids, table))
                _leave_exact_at_fence(tracked, chain, chain.position + self.chunk_tokens)
                tracked.tail_saved_at = -1  # the off-chain tail at this position is another
            start = chain.position
            link = chain.extend(token_ids[start : start + self.chunk_tokens])
            key = (tracked.namespace, link.key)
            if link.key in tracked.held_keys or not self._claim(key, tracked.ack_seq):
                continue
            table = tuple(tracked.block_ids) if table is None else table
            saves.append(self._save_spec(tracked, link, token_ids, table))
        tail = self._tail(tracked, ready)
        if tail is not None:
            table = tuple(tracked.block_ids) if table is None else table
            saves.append(self._save_spec(tracked, tail, token_ids, table))
        return saves

    def _tail(self, tracked: _Tracked, ready: int) -> ChainLink | None:
        """The half-chunk segment past the chain's last full chunk, once its blocks exist.

        NOTE: chunks keep puts few and large, but a request's last partial chunk would
        then never be stored: the next agent of a transcript (this one's prompt and
        answer, then more) would recompute up to a chunk less than vLLM's own prefix
        cache holds. One half-chunk tail per chunk (whole blocks) halves that, for at
        most half a chunk more bytes; the full chunk is stored when it fills.
        """
        chain = tracked.chain
        assert chain is not None
        end = chain.position + self.tail_tokens
        if not self.tail_tokens or end > ready or tracked.tail_saved_at == chain.position:
            return None
        _leave_exact_at_fence(tracked, chain, end)
        tracked.tail_saved_at = chain.position
        link = chain.peek(tracked.request.all_token_ids[chain.position : end])
        if link.key in tracked.held_keys or not self._claim(
            (tracked.namespace, link.key), tracked.ack_seq
        ):
            return None
        return link

    def _save_spec(
        self, tracked: _Tracked, link: ChainLink, token_ids: Sequence[int], table: tuple[int, ...]
    ) -> SaveSpec:
        assert tracked.root is not None
        return SaveSpec(
            request_id=tracked.request.request_id, namespace=tracked.namespace,
            root=tracked.root, start=link.start, token_ids=tuple(token_ids[link.start : link.end]),
            parent_key=link.parent_key, key=link.key, block_size=self.block_size,
            block_table=table, exact=tracked.chain is not None and tracked.chain.exact,
        )  # fmt: skip

    def _claim(self, key: tuple[str, bytes], lookup_ack_seq: int) -> bool:
        """Whether this request should put `key`: nobody is putting it now, and it was not
        acknowledged since the request's lookup (acknowledged before and not found by the
        lookup: evicted, or past a hole; put again)."""
        if key in self._in_flight or self._acked.get(key, -1) > lookup_ack_seq:
            return False
        self._in_flight[key] = time.monotonic()
        return True

    def _expire_in_flight(self) -> None:
        if not self._in_flight:
            return
        oldest = time.monotonic() - IN_FLIGHT_TTL_S
        if next(iter(self._in_flight.values())) < oldest:
            self._in_flight = {k: t for k, t in self._in_flight.items() if t >= oldest}

    # ---- bookkeeping ---------------------------------------------------------------------

    def _track(self, request: Any) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            return tracked
        namespace = salted_namespace(self.clients.config.namespace, request.cache_salt)
        root = request_root(self.fingerprint, request)
        chain = None if root is None else KeyChain(root)
        reuse = requested_reuse(request)
        if reuse.problem:
            self.faults.record("a request's kv_transfer_params were ignored", reuse.problem)
        tracked = _Tracked(request, namespace, root, chain, reuse=reuse)
        self._tracked[request.request_id] = tracked
        return tracked

    def _take_load(self, tracked: _Tracked, loads: list[LoadSpec]) -> None:
        if tracked.pending_load is not None:
            loads.append(tracked.pending_load)
            tracked.pending_load = None


def _outcome(tracked: _Tracked, admitted: bool) -> GatedOutcome:
    lookup = tracked.lookup
    return GatedOutcome(
        admitted, lookup is not None, lookup.num_matched_tokens if lookup else 0,
        len(tracked.spans), tracked.num_promised_runs, tracked.num_approximate_tokens,
        tracked.load_failed,
    )  # fmt: skip


def _asked(request: Any) -> bool:
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and KEY in params


def _leave_exact_at_fence(tracked: _Tracked, chain: KeyChain, end: int) -> bool:
    """Move `chain` off-chain if its next link, ending at `end`, reaches the request's
    first approximate token; whether it just left."""
    fence = tracked.approximate_from
    if not chain.exact or fence is None or end <= fence:
        return False
    chain.leave_exact()
    return True


def _stale(tracked: _Tracked, num_tokens: int) -> bool:
    """Whether the request changed (a resumed request has more tokens) or waited so long
    since its lookup that what it found may have been evicted."""
    age_s = time.monotonic() - tracked.looked_up_s
    return tracked.num_lookup_tokens != num_tokens or age_s > LOOKUP_MAX_AGE_S


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
