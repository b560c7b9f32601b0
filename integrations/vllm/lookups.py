"""Prefix lookups off vLLM's scheduler loop: asked once, answered when the sidecar answers.

vLLM lets a connector answer "ask again next step" (`None`) while it finds out what an
external cache holds. `Lookups.poll` starts the lookup on a small thread pool, waits
for it the first time it is asked (a healthy sidecar answers within a millisecond or two,
so most requests are scheduled in the step they arrive), and afterwards never blocks:
`None` until the answer is there, a miss once `timeout_s` has passed. The first-time waits
share one budget per scheduler step (`wait_s`, renewed by `new_step`): 16 new requests
against a slow sidecar stall their step by `wait_s`, not 16 times it. Every fault is a miss, counted by `FaultLog` and fed to the breaker.
An answer (`Found`) is the exact stored prefix and, for a request that opted into
approximate reuse, the runs of stored segments that continue it (`span_cover`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from kvsplice.common.breaker import CircuitBreaker
from kvsplice.common.errors import InvalidRequest, PermissionDenied, StoreUnavailable
from kvsplice.integrations.vllm.sessions import SessionScope
from kvsplice.integrations.vllm.sidecar_faults import FaultLog
from kvsplice.integrations.vllm.span_cover import ReusedSpan
from kvsplice.storeclient.results import PrefixLookup

# Refusals of one request's lookup (a salt its token does not cover, an over-long
# prompt): the sidecar itself is healthy, so they do not trip the breaker.
REQUEST_REFUSALS = (PermissionDenied, InvalidRequest)


@dataclass(frozen=True)
class LookupQuery:
    namespace: str
    root: str  # the fingerprint the request's chain hangs from (request_keys)
    num_tokens: int
    approximate: bool = False  # also look for stored runs past the exact prefix
    exact_bases: bool = False  # only runs of segments computed on an exact chain (anchor)
    session: SessionScope | None = None  # the agent session asking (`sessions`)


@dataclass(frozen=True)
class Found:
    """The exact stored prefix, and runs computed elsewhere that continue it (approximate)."""

    exact: PrefixLookup
    spans: tuple[ReusedSpan, ...] = ()


MISS = Found(PrefixLookup.MISS)


@dataclass
class _Pending:
    query: LookupQuery
    future: Future[Found]
    started_s: float


LookupFn = Callable[[LookupQuery, Sequence[int]], Found]


class Lookups:
    def __init__(
        self,
        lookup: LookupFn,
        *,
        wait_s: float,
        timeout_s: float,
        breaker: CircuitBreaker,
        faults: FaultLog,
        max_workers: int = 4,
    ) -> None:
        self._lookup = lookup
        self.wait_s = wait_s
        self.timeout_s = timeout_s
        self.breaker = breaker
        self.faults = faults
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvsplice-lookup")
        self._pending: dict[str, _Pending] = {}
        self._step_deadline: float | None = None  # this step's first waits end then
        self.num_lookups = 0
        self.num_deferred = 0
        self.num_failed_lookups = 0  # timed out, refused or failed: answered as a miss
        self._failed_lock = threading.Lock()
        self.waited_s = 0.0  # the first-time waits granted, summed (what the steps could stall)

    def poll(self, request_id: str, query: LookupQuery, token_ids: Sequence[int]) -> Found | None:
        """The lookup's answer, MISS on any fault, or None: not answered yet, ask again.

        `token_ids` are the request's tokens (its first `query.num_tokens` are looked up).
        """
        pending = self._pending.get(request_id)
        wait_s = 0.0
        if pending is None or pending.query != query:
            if not self.breaker.allow():
                return MISS
            tokens = tuple(token_ids[: query.num_tokens])  # vLLM appends to its list
            future = self._pool.submit(self._guarded, query, tokens)
            pending = _Pending(query, future, time.monotonic())
            self._pending[request_id] = pending
            self.num_lookups += 1
            wait_s = self._step_budget()
            self.waited_s += wait_s
        try:
            lookup = pending.future.result(timeout=wait_s)
        except FutureTimeout:
            if time.monotonic() - pending.started_s < self.timeout_s:
                self.num_deferred += 1
                return None
            del self._pending[request_id]
            self._count_failed()
            self.faults.record("lookup timed out", f"no answer in {self.timeout_s:.1f} s")
            self.breaker.record_failure("lookup timed out")
            return MISS
        del self._pending[request_id]
        return lookup

    def new_step(self) -> None:
        """A scheduler step ended: the next one's first-time waits share a fresh `wait_s`."""
        self._step_deadline = None

    def _step_budget(self) -> float:
        """What is left of this step's wait budget (the whole `wait_s` for its first lookup)."""
        now = time.monotonic()
        if self._step_deadline is None:
            self._step_deadline = now + self.wait_s
        return max(0.0, self._step_deadline - now)

    def forget(self, request_id: str) -> None:
        """The request finished (or was aborted) before its lookup was asked for again."""
        self._pending.pop(request_id, None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _count_failed(self) -> None:
        with self._failed_lock:  # lookups fail on the pool's threads
            self.num_failed_lookups += 1

    def _guarded(self, query: LookupQuery, token_ids: Sequence[int]) -> Found:
        try:
            lookup = self._lookup(query, token_ids)
        except REQUEST_REFUSALS as error:
            self._count_failed()
            self.faults.record(f"lookup refused ({type(error).__name__})", error)
            return MISS
        except StoreUnavailable as error:
            self._count_failed()
            self.faults.record(unavailable_kind(error), error)
            self.breaker.record_failure(error)
            return MISS
        except Exception as error:  # any other status or bug: a miss, never the engine
            self._count_failed()
            self.faults.record(f"lookup failed ({type(error).__name__})", error)
            self.breaker.record_failure(error)
            return MISS
        self.breaker.record_success()
        return lookup


def unavailable_kind(error: Exception) -> str:
    """How to name an unreachable sidecar in the log: a TLS mistake is not an outage."""
    text = str(error).lower()
    if "ssl" in text or "handshake" in text or "certificate" in text:
        return "sidecar TLS handshake failed (check tls_ca, tls_cert/tls_key and its certificate)"
    return "sidecar unavailable"
