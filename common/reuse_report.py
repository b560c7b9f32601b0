"""What a worker reused, as it reports it to the sidecar: calls, prompt tokens, reused tokens
by where they were served (and how many of them were approximate), and reads of segments
the sidecar never saw (local, in place).

Owns the one definition of the token hit rate (`token_hit_rate`) that every report of
it uses: reused prompt tokens / prompt tokens, both counted by the worker that ran the
calls. Also owns `ReuseReporter`, the worker's buffer that merges call reports until one
send takes them all (a call never waits on the network); the send itself is the caller's
(the store client's RPC), and storing is the server's.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from kvsplice.common.keys import KEY_NBYTES

logger = logging.getLogger(__name__)

# Where reused K/V came from, nearest first: the worker's own decoded tier, the
# sidecar's LMDB map read in place on its host, or the sidecar over gRPC.
Served = Literal["local", "in_place", "grpc"]
SERVED: tuple[Served, ...] = get_args(Served)
# Reads the sidecar does not see itself (a gRPC read is counted where it is served).
UNSEEN_SERVED: tuple[Served, ...] = ("local", "in_place")
# One report holds at most this many segments' reads (the rest still count as tokens).
MAX_REPORTED_SEGMENTS = 1024
MAX_REPORTED_COUNT = 1 << 50


def token_hit_rate(num_hit_tokens: int, num_prompt_tokens: int) -> float | None:
    """Reused prompt tokens / prompt tokens in [0, 1]; None before the first call.

    LMCache's and vLLM's definition (the share of prompt tokens served from a cache),
    and the one hit rate kvsplice reports: /v1/stats, /metrics, the dashboard,
    `kvsplice stats`, the demo.
    """
    return num_hit_tokens / num_prompt_tokens if num_prompt_tokens else None


def _check_count(name: str, value: int) -> None:
    if not 0 <= value <= MAX_REPORTED_COUNT:
        raise ValueError(f"{name} {value} not in [0, {MAX_REPORTED_COUNT}]")


class TokenHits:
    """The reused-token total and the token hit rate of a record that counts prompt tokens,
    the reused ones by where they were served, and how many of those were approximate."""

    num_prompt_tokens: int
    hit_tokens: Mapping[Served, int]
    num_approximate_hit_tokens: int

    @property
    def num_hit_tokens(self) -> int:
        return sum(self.hit_tokens.values())

    @property
    def num_exact_hit_tokens(self) -> int:
        """Reused tokens whose K/V equal dense prefill of the same prompt (chain hits)."""
        return self.num_hit_tokens - self.num_approximate_hit_tokens

    @property
    def hit_rate(self) -> float | None:
        """The token hit rate in [0, 1] (`token_hit_rate`); None before the first call."""
        return token_hit_rate(self.num_hit_tokens, self.num_prompt_tokens)


@dataclass(frozen=True)
class ReuseReport(TokenHits):
    """Reuse over `num_calls` calls: their prompt tokens, the reused ones by `Served`,
    `segment_reads`: (context key, served) -> reads, only for `UNSEEN_SERVED`, and
    `num_approximate_hit_tokens`: of the reused tokens, those approximate (K/V computed
    for the same tokens at another position or after another prefix; the rest are exact)."""

    num_calls: int = 0
    num_prompt_tokens: int = 0
    hit_tokens: Mapping[Served, int] = field(default_factory=dict)
    segment_reads: Mapping[tuple[bytes, Served], int] = field(default_factory=dict)
    num_approximate_hit_tokens: int = 0

    def __post_init__(self) -> None:
        _check_count("num_calls", self.num_calls)
        _check_count("num_prompt_tokens", self.num_prompt_tokens)
        for served, n in self.hit_tokens.items():
            if served not in SERVED:
                raise ValueError(f"served {served!r} is not one of {SERVED}")
            _check_count(f"hit_tokens[{served}]", n)
        if self.num_hit_tokens > self.num_prompt_tokens:
            raise ValueError(
                f"{self.num_hit_tokens} reused tokens > {self.num_prompt_tokens} prompt tokens"
            )
        if not 0 <= self.num_approximate_hit_tokens <= self.num_hit_tokens:
            raise ValueError(
                f"{self.num_approximate_hit_tokens} approximate tokens not in "
                f"[0, {self.num_hit_tokens}] (the reused tokens)"
            )
        if len(self.segment_reads) > MAX_REPORTED_SEGMENTS:
            raise ValueError(f"{len(self.segment_reads)} segments > {MAX_REPORTED_SEGMENTS}")
        for (key, served), n in self.segment_reads.items():
            if len(key) != KEY_NBYTES:
                raise ValueError(f"context key of {len(key)} bytes, not {KEY_NBYTES}")
            if served not in UNSEEN_SERVED:
                raise ValueError(f"segment reads served {served!r}: not one of {UNSEEN_SERVED}")
            _check_count("segment reads", n)

    @property
    def empty(self) -> bool:
        return not (self.num_calls or self.num_prompt_tokens or self.segment_reads)

    def merged(self, other: ReuseReport) -> ReuseReport:
        """Both reports as one; segments past `MAX_REPORTED_SEGMENTS` lose their reads
        (their tokens stay counted)."""
        reads = dict(self.segment_reads)
        for slot, n in other.segment_reads.items():
            if slot in reads or len(reads) < MAX_REPORTED_SEGMENTS:
                reads[slot] = reads.get(slot, 0) + n
        return ReuseReport(
            self.num_calls + other.num_calls,
            self.num_prompt_tokens + other.num_prompt_tokens,
            _summed(self.hit_tokens, other.hit_tokens),
            reads,
            self.num_approximate_hit_tokens + other.num_approximate_hit_tokens,
        )

    def totals(self) -> ReuseReport:
        """The token counts alone (no segment reads)."""
        return ReuseReport(
            self.num_calls, self.num_prompt_tokens, self.hit_tokens,
            num_approximate_hit_tokens=self.num_approximate_hit_tokens,
        )  # fmt: skip


def _summed(a: Mapping[Served, int], b: Mapping[Served, int]) -> dict[Served, int]:
    return {s: a.get(s, 0) + b.get(s, 0) for s in SERVED if s in a or s in b}


@dataclass(frozen=True)
class ReusedRun:
    """`num_tokens` prompt tokens of one call reused from one stored segment (`context_key`,
    None when unknown) served from `served`; `exact`: False when the K/V were computed for
    the same tokens at another position or after another prefix (approximate reuse)."""

    num_tokens: int
    served: Served
    context_key: bytes | None = None
    exact: bool = True


def call_report(num_prompt_tokens: int, runs: Iterable[ReusedRun]) -> ReuseReport:
    """The report of one call of `num_prompt_tokens` prompt tokens that reused `runs`."""
    hit_tokens: dict[Served, int] = {}
    reads: dict[tuple[bytes, Served], int] = {}
    num_approximate = 0
    for run in runs:
        hit_tokens[run.served] = hit_tokens.get(run.served, 0) + run.num_tokens
        num_approximate += 0 if run.exact else run.num_tokens
        if run.context_key is not None and run.served in UNSEEN_SERVED:
            slot = (run.context_key, run.served)
            if slot in reads or len(reads) < MAX_REPORTED_SEGMENTS:
                reads[slot] = reads.get(slot, 0) + 1
    return ReuseReport(1, num_prompt_tokens, hit_tokens, reads, num_approximate)


# send(report) -> False when the store could not be reached (keep it for the next flush).
SendFn = Callable[[ReuseReport], bool]


class ReuseReporter:
    """Reports merged until the next flush; the flush thread starts with the first report.

    `add` merges under a lock and returns; every `interval_s` the thread sends what
    accumulated, in one RPC. A report the store could not take (unreachable) is merged
    back and sent with the next; one it refused is dropped and counted by the sender.
    """

    def __init__(self, send: SendFn, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s {interval_s} must be > 0")
        self.interval_s = interval_s
        self._send = send
        self._lock = threading.Lock()  # guards _pending and _thread
        self._sending = threading.Lock()  # one flush at a time, in report order
        self._pending = ReuseReport()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, report: ReuseReport) -> None:
        """Merge `report` into the next flush (never blocks on I/O)."""
        if report.empty:
            return
        with self._lock:
            self._pending = self._pending.merged(report)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run, name="kvsplice-reuse-reports", daemon=True
                )
                self._thread.start()

    def flush(self) -> bool:
        """Send what is pending now; False if the store could not take it (kept)."""
        with self._sending:
            with self._lock:
                report, self._pending = self._pending, ReuseReport()
            if report.empty or self._send(report):
                return True
            with self._lock:
                self._pending = report.merged(self._pending)
            return False

    def close(self) -> None:
        """Stop the thread and send what is pending (one attempt)."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception:  # a bug must not end reporting silently; the next flush retries
                logger.exception("reuse report failed")
