"""Prometheus metrics of the store sidecar: names, bounded label sets, one registry each.

Owns what is exported and validates every label value; it does not decide when
something is counted. RPCs and lookups are pushed by the servicer and interceptor;
what the tiers count themselves (requests, evictions, checksum failures, bytes held) is
read from the store at each scrape (`store_collector`), so the two can never disagree.
There is deliberately no `namespace` label here: per-tenant hit rates leak what other
tenants asked (timing/hit-rate side channels), so they go through `/v1/stats` only. The
per-namespace eviction counts (`capacity_metrics`) sit behind admin-only `/metrics`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version

import grpc
import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.exposition import generate_latest

from kvsplice.common.reuse_report import SERVED, ReuseReport
from kvsplice.server.store_collector import StatsFn, StoreCollector

logger = logging.getLogger(__name__)

PREFIX = "kvsplice"
RESULTS = ("hit", "miss")
LOOKUP_KINDS = ("exact", "similar")
DIRECTIONS = ("in", "out")
STATUS_CODES = tuple(code.name for code in grpc.StatusCode)
# 0.1 ms (a memory-tier hit) .. 10 s (a large cold Redis fetch), ~2.5x apart.
RPC_DURATION_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# 1 KiB .. 256 MiB in powers of 4: a few tokens of one layer .. a long all-layer span.
SEGMENT_SIZE_BUCKETS_BYTES = tuple(float(1024 * 4**i) for i in range(10))
_METHOD_PATTERN = re.compile(r"^[A-Z][A-Za-z0-9]{0,63}$")


def _check(label: str, value: str, allowed: Iterable[str]) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{label} {value!r} is not one of {sorted(allowed)}")
    return value


def _check_count(name: str, n: int) -> int:
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    return n


class StoreMetrics:
    """Every kvsplice_* series, in a registry of its own (no global default registry).

    `rpc_methods` is the closed set of RPC names (short names, e.g. "Lookup") that
    `observe_rpc` accepts; the wiring passes the service descriptor's methods.
    """

    def __init__(self, rpc_methods: Iterable[str], build_version: str | None = None) -> None:
        self.rpc_methods = frozenset(rpc_methods)
        if not self.rpc_methods:
            raise ValueError("rpc_methods must name at least one RPC")
        bad = sorted(m for m in self.rpc_methods if not _METHOD_PATTERN.match(m))
        if bad:
            raise ValueError(f"rpc_methods {bad} are not RPC names ({_METHOD_PATTERN.pattern})")
        # `_created` series double every counter and no dashboard reads them (process-wide).
        prometheus_client.disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self.store = StoreCollector()
        self.registry.register(self.store)
        ProcessCollector(namespace="", registry=self.registry)  # process_* (Linux /proc)
        PlatformCollector(registry=self.registry)  # python_info
        self._define_counters()
        self._define_distributions()
        self._initialize_children()
        Info(f"{PREFIX}_build", "Version of the running sidecar.", registry=self.registry).info(
            {"version": build_version or package_version()}
        )

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        # prometheus_client appends `_total` to counters itself.
        return Counter(f"{PREFIX}_{name}", doc, labels, registry=self.registry)

    def _define_counters(self) -> None:
        self.lookups = self._counter(
            "lookups", "Segment lookups by kind and result.", ("kind", "result")
        )
        self.lookup_matched_tokens = self._counter(
            "lookup_matched_tokens", "Tokens lookups found stored segments for (index coverage)."
        )
        self.lookup_queried_tokens = self._counter(
            "lookup_queried_tokens", "Tokens asked for by lookups."
        )
        # The token hit rate: sum(hit_tokens) / prompt_tokens, as workers reported them.
        self.prompt_tokens = self._counter(
            "prompt_tokens", "Prompt tokens of the calls workers reported."
        )
        self.hit_tokens = self._counter(
            "hit_tokens", "Prompt tokens workers reused, by where served.", ("served",)
        )
        self.approximate_hit_tokens = self._counter(
            "approximate_hit_tokens",
            "Of the reused prompt tokens, those approximate (K/V computed for the same tokens "
            "at another position or after another prefix); the rest are exact.",
        )
        self.reported_calls = self._counter("reported_calls", "Calls workers reported.")
        self.segment_reads = self._counter(
            "segment_reads", "Reads of stored segments, by where served.", ("served",)
        )
        self.bytes = self._counter(
            "bytes", "Payload bytes received (in) and sent (out).", ("direction",)
        )

    def _define_distributions(self) -> None:
        self.rpc_duration = Histogram(
            f"{PREFIX}_rpc_duration_seconds",
            "Server-side RPC latency by method and gRPC status code.",
            ("method", "code"),
            buckets=RPC_DURATION_BUCKETS_S,
            registry=self.registry,
        )
        self.segment_size = Histogram(
            f"{PREFIX}_segment_size_bytes",
            "Payload size of stored segments.",
            buckets=SEGMENT_SIZE_BUCKETS_BYTES,
            registry=self.registry,
        )

    def _initialize_children(self) -> None:
        # Known label combinations start at 0 so rate() works from the first scrape.
        for kind in LOOKUP_KINDS:
            for result in RESULTS:
                self.lookups.labels(kind, result)
        for direction in DIRECTIONS:
            self.bytes.labels(direction)
        for served in SERVED:
            self.hit_tokens.labels(served)
            self.segment_reads.labels(served)

    def observe_rpc(self, method: str, seconds: float, code: str) -> None:
        """Record one finished RPC; `code` is a gRPC status name ("OK", "NOT_FOUND")."""
        _check("method", method, self.rpc_methods)
        _check("code", code, STATUS_CODES)
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self.rpc_duration.labels(method, code).observe(seconds)

    def record_lookup(self, kind: str, hit: bool, queried_tokens: int, hit_tokens: int) -> None:
        """Record one lookup of `queried_tokens`, of which `hit_tokens` were found."""
        _check("kind", kind, LOOKUP_KINDS)
        _check_count("queried_tokens", queried_tokens)
        if not 0 <= hit_tokens <= queried_tokens:
            raise ValueError(f"hit_tokens {hit_tokens} not in [0, {queried_tokens}]")
        self.lookups.labels(kind, "hit" if hit else "miss").inc()
        self.lookup_queried_tokens.inc(queried_tokens)
        self.lookup_matched_tokens.inc(hit_tokens)

    def record_reuse(self, report: ReuseReport) -> None:
        """Add a worker's reuse report (a validated `ReuseReport`)."""
        self.reported_calls.inc(report.num_calls)
        self.prompt_tokens.inc(report.num_prompt_tokens)
        for served, n in report.hit_tokens.items():
            self.hit_tokens.labels(served).inc(n)
        self.approximate_hit_tokens.inc(report.num_approximate_hit_tokens)
        for (_key, served), n in report.segment_reads.items():
            self.segment_reads.labels(served).inc(n)

    def record_read(self, served: str) -> None:
        """Count one read of a stored segment served from `served` (the sidecar's: grpc)."""
        self.segment_reads.labels(_check("served", served, SERVED)).inc()

    def add_bytes(self, direction: str, n: int) -> None:
        """Count `n` payload bytes received ("in") or sent ("out")."""
        self.bytes.labels(_check("direction", direction, DIRECTIONS)).inc(_check_count("n", n))

    def observe_segment_size(self, n: int) -> None:
        """Record the payload size of one stored segment."""
        self.segment_size.observe(_check_count("n", n))

    def bind_store(self, stats_fn: StatsFn | None) -> None:
        """Read the store's `StoreStats` from `stats_fn` at every scrape (None unbinds).

        Scrapes run on the event loop, so `stats_fn` must be cheap (counters, not scans).
        """
        self.store.bind(stats_fn)

    def render(self) -> tuple[bytes, str]:
        """Return the text exposition of every series and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def package_version() -> str:
    try:
        return version("kvsplice")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"
