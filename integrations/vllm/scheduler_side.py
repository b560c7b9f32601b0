"""The connector's scheduler half: vLLM's request state, and the rooms it asks about it.

Per request: its lookup (`Lookups`, off the loop) and what that promises (`promise`,
behind its `Fence`), its load (`PromisedLoads`), its saves (`SaveChain`, claimed in the
`SaveLedger`), and the workers' news (`absorb`). Knows vLLM's request and scheduler-output
objects only through the few attributes it reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvsplice.common.breaker import CircuitBreaker
from kvsplice.integrations.vllm.connector_config import salted_namespace
from kvsplice.integrations.vllm.fence import Fence
from kvsplice.integrations.vllm.gated_report import GatedOutcome, reuse_report
from kvsplice.integrations.vllm.lookups import LookupQuery, Lookups
from kvsplice.integrations.vllm.promise import Answer, promise
from kvsplice.integrations.vllm.promised_loads import PromisedLoads
from kvsplice.integrations.vllm.request_keys import request_root
from kvsplice.integrations.vllm.reuse_request import RequestedReuse, asked, requested_reuse
from kvsplice.integrations.vllm.save_chain import SaveChain, SaveRules
from kvsplice.integrations.vllm.save_ledger import SaveLedger
from kvsplice.integrations.vllm.sessions import SessionEnds, SessionScope, session_scope
from kvsplice.integrations.vllm.sidecar_faults import FaultLog, sidecar_breaker
from kvsplice.integrations.vllm.span_cover import ReusedSpan, trimmed
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.integrations.vllm.store_lookup import StoreLookup
from kvsplice.integrations.vllm.transfer_specs import LoadSpec, RequestStart, SaveSpec, WorkerNews
from kvsplice.storeclient.results import PrefixLookup

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    """One request from its first lookup until it finishes."""

    request: Any  # vllm.v1.request.Request
    namespace: str
    root: str | None  # None: its K/V is never shared (request_keys)
    saves: SaveChain | None  # None: nothing of it is saved (no root)
    reuse: RequestedReuse
    fence: Fence
    session: SessionScope | None = None  # its agent session (`sessions`)
    answer: Answer | None = None  # None: not answered yet
    promised_spans: tuple[ReusedSpan, ...] = ()  # the approximate runs of the last promise
    num_local_tokens: int = 0  # computed or cached in the engine when the load was promised
    load_async: bool = False  # its promised load goes beside the steps (vLLM's load_kv_async)
    block_ids: list[int] = field(default_factory=list)
    num_exact_tokens: int = 0  # loaded from exact chain links (the last load)
    num_approximate_tokens: int = 0  # loaded from runs computed elsewhere (the last load)
    num_promised_runs: int = 0  # approximate runs the last promise loads
    load_failed: bool = False  # a load of it failed (the worker's news)
    # NOTE: where its first failed load stopped: never promised past it again (vLLM's
    # "recompute" asks again; the cached answer would promise the same failing piece)
    max_promise_tokens: int | None = None


class SchedulerSide:
    def __init__(
        self, clients: StoreClients, fingerprint: str, block_size: int, chunk_tokens: int,
        save_decode: bool = False, *, save_tails: bool = True, load_async: str = "never",
        lookup_wait_s: float = 0.02, lookup_timeout_s: float = 2.0,
        breaker: CircuitBreaker | None = None, faults: FaultLog | None = None,
        approximate: bool = False, hash_block_size: int | None = None,
    ) -> None:  # fmt: skip
        self.namespace = clients.config.namespace
        self.fingerprint = fingerprint
        # whether the admission policy admits approximate runs for requests that opt in
        self.approximate = approximate
        self.block_size = block_size
        self.hash_block_size = hash_block_size or block_size  # vLLM's prefix-cache hashes
        self.rules = SaveRules.of(block_size, chunk_tokens, save_tails, save_decode)
        self.faults = faults or FaultLog()
        store_lookup = StoreLookup(
            clients, block_size=block_size, chunk_tokens=chunk_tokens,
            timeout_s=lookup_timeout_s, faults=self.faults,
        )  # fmt: skip
        self.lookups = Lookups(
            store_lookup, wait_s=lookup_wait_s, timeout_s=lookup_timeout_s,
            breaker=breaker or sidecar_breaker(), faults=self.faults,
        )  # fmt: skip
        self.loads = PromisedLoads(block_size, load_async, self.faults)
        self.ledger = SaveLedger()
        self.session_ends = SessionEnds(clients)
        self._tracked: dict[str, _Tracked] = {}
        self.disabled: str | None = None
        self.num_hit_tokens = 0
        self.num_promised_exact_tokens = 0  # of num_hit_tokens: from exact chain links
        self.num_promised_approximate_tokens = 0  # and from approximate runs
        self.num_faults_seen = 0  # load faults absorbed: the worker withholds saves until then

    @property
    def num_lookups(self) -> int:
        return self.lookups.num_lookups

    # ---- lookups and the promise ---------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens past `num_computed_tokens` the sidecar holds, whole blocks, leaving one to
        compute; None while the lookup is under way (vLLM asks again next step)."""
        tracked = self._track(request)
        tracked.num_local_tokens = num_computed_tokens
        num_tokens = len(request.all_token_ids)
        cap = (num_tokens - 1) // self.block_size * self.block_size
        if tracked.max_promise_tokens is not None:
            cap = min(cap, tracked.max_promise_tokens)
        if self.disabled or tracked.saves is None or cap <= num_computed_tokens:
            return 0  # nothing the sidecar could add: no lookup
        stale = tracked.answer is None or tracked.answer.is_stale(num_tokens)
        if stale and not self._ask(tracked, tracked.saves):
            return None  # asked: the answer comes in a later step
        assert tracked.answer is not None
        promised = promise(tracked.answer, cap, num_computed_tokens, self.block_size)
        tracked.promised_spans = promised.spans
        if promised.fence is not None:
            tracked.fence.place(tracked.request, promised.fence, self.hash_block_size)
        num_new = max(0, promised.end - num_computed_tokens)
        tracked.load_async = num_new > 0 and self.loads.is_async(request.request_id)
        return num_new

    def is_async_load(self, request: Any) -> bool:
        """Whether the load `num_new_matched_tokens` just promised goes beside the steps."""
        tracked = self._tracked.get(request.request_id)
        return tracked is not None and tracked.load_async

    def _ask(self, tracked: _Tracked, saves: SaveChain) -> bool:
        """Ask (or ask again) for the request's lookup; whether the sidecar answered. What it
        found stored is not put again by this request (nor by one it is not looked up for)."""
        request, root = tracked.request, saves.root
        query = LookupQuery(
            tracked.namespace, root, len(request.all_token_ids),
            approximate=self._wants_spans(tracked), session=tracked.session,
        )  # fmt: skip
        found = self.lookups.poll(request.request_id, query, request.all_token_ids)
        if found is None:
            return False
        found = self.ledger.without_bad(found)
        held = frozenset(ref.context_key for ref in found.exact.segments)
        saves.found(held, self.ledger.found_stored(tuple((tracked.namespace, k) for k in held)))
        tracked.answer = Answer(found.exact, found.spans, query.num_tokens, time.monotonic())
        return True

    def _wants_spans(self, tracked: _Tracked) -> bool:
        return self.approximate and tracked.reuse.approximate and tracked.root is not None

    # ---- allocation and steps ------------------------------------------------------------

    def after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Remember where the promised tokens go; a load is built for the next step."""
        tracked = self._tracked.get(request.request_id)
        if tracked is None or num_external_tokens <= 0:
            return
        start = tracked.num_local_tokens
        end = start + num_external_tokens
        spans = trimmed(tracked.promised_spans, start, end)
        exact_end = spans[0].start if spans else end
        lookup = tracked.answer.lookup if tracked.answer else PrefixLookup.MISS
        load = self.loads.promise(
            request.request_id, tracked.namespace, tracked.root or "", lookup,
            request.all_token_ids, block_ids, start, end, spans, is_async=tracked.load_async,
        )  # fmt: skip
        tracked.num_exact_tokens = exact_end - start
        tracked.num_approximate_tokens = end - exact_end
        tracked.num_promised_runs = len(load.spans)
        self.num_promised_exact_tokens += tracked.num_exact_tokens
        self.num_promised_approximate_tokens += tracked.num_approximate_tokens
        self.num_hit_tokens += num_external_tokens

    def build_step(
        self, scheduler_output: Any
    ) -> tuple[list[LoadSpec], list[SaveSpec], list[RequestStart]]:
        self.lookups.new_step()
        loads = self.loads.take_async()
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
                if self.loads.pending(req_id):  # its hits are reported too
                    starts.append(RequestStart(req_id, tracked.namespace, 0))
            elif new_blocks is not None:
                tracked.block_ids.extend(new_blocks[0])
            scheduled = scheduler_output.num_scheduled_tokens[req_id]
            computed.append((tracked, cached.num_computed_tokens[i] + scheduled))
        for tracked, _ in computed:
            load = self.loads.take(tracked.request.request_id)
            if load is not None:
                loads.append(load)
        self.loads.ran({tracked.request.request_id for tracked, _ in computed})
        return loads, self._all_saves(computed, scheduler_output), starts

    def finished(self, request: Any) -> dict[str, Any] | None:
        """Forget the request; for one that asked for a reuse mode, what it got (returned
        to the client in the response's `kv_transfer_params`)."""
        tracked = self._tracked.pop(request.request_id, None)
        self.loads.forget(request.request_id)
        self.lookups.forget(request.request_id)
        if tracked is not None and tracked.session is not None and tracked.session.release:
            self.session_ends.end(tracked.namespace, tracked.session)
        if tracked is None or not asked(request):
            return None
        admitted = self._wants_spans(tracked)
        return reuse_report(tracked.reuse, _outcome(tracked, admitted), tracked.num_exact_tokens)

    # ---- what the workers report ---------------------------------------------------------

    def absorb(self, news: WorkerNews) -> None:
        """Acknowledged puts count as stored; failed ones are free to be put again; a load
        fault rewinds its request's chain and keeps a corrupt segment from being promised."""
        self.ledger.acknowledge(news.acked)
        self.ledger.fail(news.failed)
        for fault in news.faults:
            self.num_faults_seen += 1
            if fault.corrupt_segment_id is not None:
                self.ledger.mark_bad(fault.corrupt_segment_id)
            tracked = self._tracked.get(fault.request_id)
            if tracked is not None:
                tracked.load_failed = True
                before = tracked.max_promise_tokens
                tracked.max_promise_tokens = min(
                    fault.position, before if before is not None else fault.position
                )
                if tracked.saves is not None:
                    tracked.saves.rewind(fault.position, tracked.request.all_token_ids)
        if news.disabled and not self.disabled:
            self.disabled = news.disabled
            logger.error("kvsplice connector off (nothing promised): %s", news.disabled)

    # ---- saves ---------------------------------------------------------------------------

    def _all_saves(
        self, computed: list[tuple[_Tracked, int]], scheduler_output: Any
    ) -> list[SaveSpec]:
        saves: list[SaveSpec] = []
        self.ledger.expire()
        for tracked, num_computed in computed:
            try:
                saves.extend(self._saves(tracked, num_computed, scheduler_output))
            except Exception as error:  # a save not made is a future miss
                self.faults.record("planning saves failed", error)
        return saves

    def _saves(self, tracked: _Tracked, num_computed: int, scheduler_output: Any) -> list[SaveSpec]:
        """The request's chunks whose K/V exists after this step (in its blocks, draft tokens
        of speculative decoding left out: they may be rejected) and is not stored."""
        if tracked.saves is None or self.disabled:
            return []
        request = tracked.request
        num_draft = len(scheduler_output.scheduled_spec_decode_tokens.get(request.request_id, ()))
        computed = min(num_computed - num_draft, len(tracked.block_ids) * self.block_size)
        return tracked.saves.plan(
            request.all_token_ids, request.num_prompt_tokens, computed, tracked.block_ids,
            self.ledger,
        )  # fmt: skip

    # ---- bookkeeping ---------------------------------------------------------------------

    def _track(self, request: Any) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            return tracked
        namespace = salted_namespace(self.namespace, request.cache_salt)
        root = request_root(self.fingerprint, request)
        reuse = requested_reuse(request)
        if reuse.problem:
            self.faults.record("a request's kv_transfer_params were ignored", reuse.problem)
        fence = Fence()
        session = session_scope(request)
        # NOTE: a released session's own puts are not held: one landing after the release
        # would start the session again, held for a whole lease nobody renews.
        held_for = "" if session is None or session.release else session.session_id
        saves = (
            None
            if root is None
            else SaveChain(request.request_id, namespace, root, self.rules, fence, held_for)
        )
        tracked = _Tracked(request, namespace, root, saves, reuse, fence, session)
        self._tracked[request.request_id] = tracked
        return tracked


def _outcome(tracked: _Tracked, admitted: bool) -> GatedOutcome:
    answer = tracked.answer
    return GatedOutcome(
        admitted, answer is not None, answer.lookup.num_matched_tokens if answer else 0,
        len(answer.spans) if answer else 0, tracked.num_promised_runs,
        tracked.num_approximate_tokens, tracked.load_failed,
    )  # fmt: skip
