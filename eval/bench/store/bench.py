"""`bench store`: the store sidecar on loopback: put/get MB/s per tier and lookup latency.

Owns the measurement and its rows: transfers beside `numpy.copyto` of the same bytes,
exact/similarity p50/p99 in-process (via `index.bench_lookup`) and through gRPC end to
end. Prints nothing; `report` draws tables and JSON, the CLI prints them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import NamedTuple, TypeVar

import numpy as np

from kvsplice.common.errors import StoreUnavailable
from kvsplice.common.segment import SegmentMeta
from kvsplice.eval.bench.store.config import StoreBenchConfig
from kvsplice.eval.bench.store.paths import PathRow, bench_read_paths
from kvsplice.eval.bench.store.payloads import (
    MIB,
    VOCAB_SIZE,
    CopyTimed,
    copyto_of,
    make_payload,
    make_segment_meta,
)
from kvsplice.eval.bench.store.put_floor import PutFloorRow, bench_put_floor
from kvsplice.eval.bench.store.put_path import PutPathRow, bench_put_path
from kvsplice.eval.measure.machine_load import warn_if_busy
from kvsplice.eval.measure.stopwatch import median_seconds
from kvsplice.index.bench_lookup import (
    BENCH_FINGERPRINT,
    BENCH_NAMESPACE,
    LatencyReport,
    make_workload,
    measure_lookup_latency,
)
from kvsplice.server.app import StoreServer, build
from kvsplice.server.config import ServerConfig
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storage.config import LMDBTierConfig, StoreConfig, build_store
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig
from kvsplice.storeclient.wire import with_payload_digest

logger = logging.getLogger(__name__)

T = TypeVar("T")

TIERS = ("memory", "lmdb")
GET_TARGET_SIZE_MIB = 8
GET_TARGET_MB_S = 500.0
GET_STRETCH_MB_S = 1000.0
LOOKUP_KINDS = ("exact", "similarity")
LOOKUP_TARGET_P99_MS = {"exact": 1.0, "similarity": 5.0}  # stated at 100k segments
# Long deadlines: a call that timed out would come back as a miss and void the figures.
CLIENT_CONFIG = StoreClientConfig(lookup_timeout_s=10.0, get_timeout_s=120.0, put_timeout_s=120.0)
_LOOKUP_PAYLOAD_NBYTES = 64
_LOOKUP_RECORD_BUDGET_NBYTES = 16 << 10  # per lookup segment: meta, payload, LMDB pages
_NUM_WARMUP_QUERIES = 10
_NUM_CHANNEL_WARMUPS = 2


@dataclass(frozen=True)
class TransferRow(CopyTimed):
    """Median seconds of one put or get through gRPC, and of `numpy.copyto` of the same bytes."""

    tier: str  # "memory": a memory tier alone; "lmdb": an LMDB tier alone
    operation: str  # "put" | "get"
    size_mib: int
    seconds: float
    copyto_seconds: float
    target_mb_s: float | None  # None: no target for this row

    @property
    def target_met(self) -> bool | None:
        return None if self.target_mb_s is None else self.mb_per_s >= self.target_mb_s


@dataclass(frozen=True)
class LookupRow:
    """Per-query latency of one index kind over `num_segments` segments.

    `path` "in-process" calls the index alone; "grpc" is StoreClient → loopback →
    server → index and back. `cpu_*` are CPU time per query (in-process: the calling
    thread; gRPC: the whole process, client and server threads), which excludes the
    preemption that inflates the wall-clock p99 on a loaded host. `populate_s` is the
    time to get the index filled (and the server serving), by `populated_via`.
    """

    path: str
    kind: str
    num_segments: int
    num_queries: int
    p50_ms: float
    p99_ms: float
    cpu_p50_ms: float
    cpu_p99_ms: float
    hit_rate: float
    populated_via: str
    populate_s: float
    target_p99_ms: float

    @property
    def target_met(self) -> bool:
        return self.p99_ms <= self.target_p99_ms

    @property
    def cpu_target_met(self) -> bool:
        """The target held against CPU time: what an unloaded host would show at best."""
        return self.cpu_p99_ms <= self.target_p99_ms


@dataclass(frozen=True)
class StoreBenchResult:
    """All rows of one run and the host's load average (1, 5, 15 min) before and after it."""

    config: StoreBenchConfig
    transfers: tuple[TransferRow, ...]
    lookups: tuple[LookupRow, ...]
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    num_cpus: int
    seconds: float
    paths: tuple[PathRow, ...] = ()
    put_path: tuple[PutPathRow, ...] = ()
    put_path_load: tuple[float, float, float] = (0.0, 0.0, 0.0)  # load average before it
    put_path_floor: tuple[PutFloorRow, ...] = ()  # the same bytes by os.pwrite + fdatasync


def run_store_bench(config: StoreBenchConfig) -> StoreBenchResult:
    """Transfers per tier and size, then lookups per count (in-process, then gRPC)."""
    start_s, load_before = time.perf_counter(), os.getloadavg()
    warn_if_busy()
    with tempfile.TemporaryDirectory(prefix="kvsplice-bench-store-", dir=config.tmp_dir) as tmp:
        put_path_load = os_load(os.getloadavg())
        put_path = bench_put_path(
            config.put_path_sizes_mib, config.repeats, Path(tmp), CLIENT_CONFIG, config.seed
        )
        put_path_floor = bench_put_floor(
            config.put_path_sizes_mib, config.repeats, Path(tmp), config.seed
        )
        paths = bench_read_paths(
            config.path_sizes_mib,
            config.repeats,
            Path(tmp),
            CLIENT_CONFIG,
            config.seed,
            config.lmdb_sync,
        )
        transfers = [row for tier in TIERS for row in _bench_tier(config, tier, Path(tmp))]
        lookups: list[LookupRow] = []
        for count in config.lookup_counts:
            lookups += bench_in_process_lookups(count, config)
            if config.include_grpc_lookups:
                lookups += bench_grpc_lookups(count, config, Path(tmp) / f"lookups-{count}")
    return StoreBenchResult(
        config=config,
        transfers=tuple(transfers),
        lookups=tuple(lookups),
        load_before=os_load(load_before),
        load_after=os_load(os.getloadavg()),
        num_cpus=os.cpu_count() or 0,
        seconds=time.perf_counter() - start_s,
        paths=tuple(paths),
        put_path=tuple(put_path),
        put_path_load=put_path_load,
        put_path_floor=tuple(put_path_floor),
    )


def os_load(values: Sequence[float]) -> tuple[float, float, float]:
    one, five, fifteen = (float(value) for value in values)
    return one, five, fifteen


# -- transfers --------------------------------------------------------------------------


def transfer_server_config(config: StoreBenchConfig, tier: str, tmp_dir: Path) -> ServerConfig:
    """One tier alone, sized to hold every segment the run puts (warm-ups included)."""
    total_nbytes = sum(config.sizes_mib) * MIB * (config.repeats + 1 + _NUM_CHANNEL_WARMUPS)
    if tier == "memory":
        return loopback_config(None, memory_bytes=total_nbytes + 64 * MIB)
    if tier != "lmdb":
        raise ValueError(f"tier {tier!r} is not one of {TIERS}")
    # No memory tier, so every get reads the LMDB map; copy-on-write needs twice the room.
    lmdb = LMDBTierConfig(
        path=str(tmp_dir / "transfer-lmdb"),
        map_size_bytes=2 * total_nbytes + 64 * MIB,
        sync=config.lmdb_sync,
    )
    return loopback_config(None, store=StoreConfig(lmdb=lmdb))


def _bench_tier(config: StoreBenchConfig, tier: str, tmp_dir: Path) -> list[TransferRow]:
    with (
        EmbeddedStore(transfer_server_config(config, tier, tmp_dir)) as store,
        StoreClient(store.target, BENCH_NAMESPACE, config=CLIENT_CONFIG) as client,
    ):
        _warm_up(client, config)
        return [row for size in config.sizes_mib for row in _bench_size(client, tier, size, config)]


def _warm_up(client: StoreClient, config: StoreBenchConfig) -> None:
    """Put and get every size a few times before timing any: a fresh channel's HTTP/2
    windows (BDP probing) and the allocators' arenas take several MiB to grow, which
    would otherwise slow the first size measured by ~2x (a worker runs warm)."""
    rng = np.random.default_rng((config.seed, 0))
    for _ in range(_NUM_CHANNEL_WARMUPS):
        for size_mib in config.sizes_mib:
            payload = make_payload(rng, size_mib * MIB)
            meta = make_segment_meta(rng, payload)
            _put(client, meta, payload)
            _get(client, meta.context_key, len(payload))


def _bench_size(
    client: StoreClient, tier: str, size_mib: int, config: StoreBenchConfig
) -> list[TransferRow]:
    """Each put stores a new segment (one per repeat, plus the warm-up); gets read them back."""
    rng = np.random.default_rng((config.seed, size_mib))
    payload = make_payload(rng, size_mib * MIB)
    metas = [make_segment_meta(rng, payload) for _ in range(config.repeats + 1)]
    pending = iter(metas)
    put_s, _ = median_seconds(lambda: _put(client, next(pending), payload), config.repeats)
    keys = itertools.cycle([meta.context_key for meta in metas])
    get_s, _ = median_seconds(lambda: _get(client, next(keys), len(payload)), config.repeats)
    copyto_s, _ = median_seconds(copyto_of(payload), config.repeats)
    target = GET_TARGET_MB_S if size_mib == GET_TARGET_SIZE_MIB else None
    rows = [
        TransferRow(tier, "put", size_mib, put_s, copyto_s, None),
        TransferRow(tier, "get", size_mib, get_s, copyto_s, target),
    ]
    logger.info("bench store %s %d MiB: %s", tier, size_mib, rows)
    return rows


def _put(client: StoreClient, meta: SegmentMeta, payload: bytes) -> None:
    if not client.put_segment(meta, payload):
        raise StoreUnavailable(f"put of segment {meta.segment_id} degraded; the run is void")


def _get(client: StoreClient, key: bytes, nbytes: int) -> None:
    stored = client.get_segment(key)
    if stored is None or len(stored[1]) != nbytes:
        raise StoreUnavailable(f"get of segment {key.hex()} missed; the run is void")


# -- lookups ----------------------------------------------------------------------------


def bench_in_process_lookups(num_segments: int, config: StoreBenchConfig) -> list[LookupRow]:
    """Both index kinds alone, as `index.bench_lookup` measures them (no store, no wire)."""
    return [
        _in_process_row(
            measure_lookup_latency(
                num_segments, kind=kind, num_queries=config.num_queries, seed=config.seed
            )
        )
        for kind in LOOKUP_KINDS
    ]


def _in_process_row(report: LatencyReport) -> LookupRow:
    return LookupRow(
        path="in-process",
        kind=report.kind,
        num_segments=report.num_segments,
        num_queries=report.num_queries,
        p50_ms=report.p50_ms,
        p99_ms=report.p99_ms,
        cpu_p50_ms=report.cpu_p50_ms,
        cpu_p99_ms=report.cpu_p99_ms,
        hit_rate=report.hit_rate,
        populated_via="index add",
        populate_s=report.num_segments / report.adds_per_s,
        target_p99_ms=LOOKUP_TARGET_P99_MS[report.kind],
    )


class _Population(NamedTuple):
    target: str
    via: str
    seconds: float


def bench_grpc_lookups(
    num_segments: int, config: StoreBenchConfig, lmdb_path: Path
) -> list[LookupRow]:
    """Both kinds through StoreClient against a store holding `num_segments` segments."""
    workload = make_workload(num_segments, seed=config.seed)
    rng = np.random.default_rng(config.seed + 1)
    via_grpc = num_segments <= config.max_grpc_populated_segments
    with (
        _lookup_store(workload.metas, via_grpc, lmdb_path) as population,
        StoreClient(population.target, BENCH_NAMESPACE, config=CLIENT_CONFIG) as client,
    ):
        calls = {
            "exact": _exact_calls(client, workload.chains, rng, config.num_queries),
            "similarity": _similar_calls(client, workload.metas, rng, config.num_queries),
        }
        rows = [_grpc_row(kind, num_segments, population, calls[kind]) for kind in LOOKUP_KINDS]
        if client.counters.num_degraded_calls:
            raise StoreUnavailable(
                f"{client.counters.num_degraded_calls} lookups degraded to misses; the run is void"
            )
    return rows


@contextmanager
def _lookup_store(
    metas: Sequence[SegmentMeta], via_grpc: bool, lmdb_path: Path
) -> Iterator[_Population]:
    start_s = time.perf_counter()
    if via_grpc:
        memory_bytes = len(metas) * _LOOKUP_RECORD_BUDGET_NBYTES + 64 * MIB
        with EmbeddedStore(loopback_config(None, memory_bytes=memory_bytes)) as store:
            _put_all(store.target, metas)
            yield _Population(store.target, "gRPC put", time.perf_counter() - start_s)
        return
    lmdb = LMDBTierConfig(
        path=str(lmdb_path),
        map_size_bytes=len(metas) * _LOOKUP_RECORD_BUDGET_NBYTES + 64 * MIB,
        sync=False,  # a bulk load; `close()` syncs once
    )
    _preload(lmdb, metas)
    with serving(loopback_config(None, store=StoreConfig(lmdb=lmdb))) as target:
        yield _Population(target, "LMDB preload + rebuild", time.perf_counter() - start_s)


def _lookup_payload(meta: SegmentMeta) -> tuple[SegmentMeta, bytes]:
    payload = meta.context_key * (_LOOKUP_PAYLOAD_NBYTES // len(meta.context_key))
    return with_payload_digest(meta, payload), payload


def _put_all(target: str, metas: Sequence[SegmentMeta]) -> None:
    with StoreClient(target, BENCH_NAMESPACE, config=CLIENT_CONFIG) as client:
        for meta in metas:
            _put(client, *_lookup_payload(meta))


def _preload(lmdb: LMDBTierConfig, metas: Sequence[SegmentMeta]) -> None:
    """Write the segments straight into the LMDB tier, as the server would have stored them."""
    store = build_store(StoreConfig(lmdb=lmdb))
    try:
        for meta in metas:
            stored, payload = _lookup_payload(meta)
            store.put(replace(stored, created_at_s=time.time()), payload)
    finally:
        store.close()


@contextmanager
def serving(config: ServerConfig) -> Iterator[str]:
    """The server on its own loop thread, for as long as its start takes; yields its target.

    NOTE: not `EmbeddedStore`, whose start gives up after 30 s: the start-up index rebuild
    of 100k segments (MinHash signatures) takes minutes on a loaded host.
    """
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kvsplice-bench-store", daemon=True)
    thread.start()
    try:
        server = _on_loop(loop, _start(config))
        try:
            yield server.address
        finally:
            _on_loop(loop, server.stop())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


async def _start(config: ServerConfig) -> StoreServer:
    server = build(config)  # inside the loop that serves, as `build` requires
    await server.start()
    return server


def _on_loop(loop: asyncio.AbstractEventLoop, coroutine: Coroutine[object, object, T]) -> T:
    return asyncio.run_coroutine_threadsafe(coroutine, loop).result()


def _exact_calls(
    client: StoreClient,
    chains: Sequence[Sequence[SegmentMeta]],
    rng: np.random.Generator,
    num_queries: int,
) -> list[Callable[[], bool]]:
    """A stored chain plus unknown trailing tokens; a hit covers the whole chain."""
    calls: list[Callable[[], bool]] = []
    for chain_id in rng.integers(0, len(chains), size=num_queries).tolist():
        chain = chains[chain_id]
        prompt = [t for meta in chain for t in meta.token_ids]
        prompt += rng.integers(0, VOCAB_SIZE, size=32).tolist()
        calls.append(partial(_exact_hit, client, prompt, chain[-1].end_position))
    return calls


def _exact_hit(client: StoreClient, prompt: list[int], expected_num_tokens: int) -> bool:
    found = client.lookup_prefix(BENCH_FINGERPRINT, prompt)
    return found.num_matched_tokens == expected_num_tokens


def _similar_calls(
    client: StoreClient, metas: Sequence[SegmentMeta], rng: np.random.Generator, num_queries: int
) -> list[Callable[[], bool]]:
    """A stored segment with its text's numbers changed, every other one with 3 token ids
    changed too; a hit returns that segment."""
    calls: list[Callable[[], bool]] = []
    for query_id, meta_id in enumerate(rng.integers(0, len(metas), size=num_queries).tolist()):
        meta = metas[meta_id]
        tokens = list(meta.token_ids)
        if query_id % 2:
            for slot in rng.integers(0, len(tokens), size=3).tolist():
                tokens[slot] = int(rng.integers(0, VOCAB_SIZE))
        words = meta.index_text.split(" ")
        text = " ".join(f"id={rng.integers(0, 10**6)}" if w.startswith("id=") else w for w in words)
        calls.append(partial(_similar_hit, client, meta, tokens, text))
    return calls


def _similar_hit(client: StoreClient, target: SegmentMeta, tokens: list[int], text: str) -> bool:
    found = client.find_similar(
        BENCH_FINGERPRINT, tokens, text=text, left_context_ids=target.left_tail_ids
    )
    return any(candidate.segment.segment_id == target.segment_id for candidate in found)


def _grpc_row(
    kind: str, num_segments: int, population: _Population, calls: Sequence[Callable[[], bool]]
) -> LookupRow:
    for call in calls[:_NUM_WARMUP_QUERIES]:
        call()
    wall_ms, cpu_ms, num_hits = [], [], 0
    for call in calls:
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        num_hits += call()
        cpu_ms.append((time.process_time() - cpu_start) * 1e3)
        wall_ms.append((time.perf_counter() - wall_start) * 1e3)
    return LookupRow(
        path="grpc",
        kind=kind,
        num_segments=num_segments,
        num_queries=len(calls),
        p50_ms=float(np.percentile(wall_ms, 50)),
        p99_ms=float(np.percentile(wall_ms, 99)),
        cpu_p50_ms=float(np.percentile(cpu_ms, 50)),
        cpu_p99_ms=float(np.percentile(cpu_ms, 99)),
        hit_rate=num_hits / len(calls),
        populated_via=population.via,
        populate_s=population.seconds,
        target_p99_ms=LOOKUP_TARGET_P99_MS[kind],
    )
