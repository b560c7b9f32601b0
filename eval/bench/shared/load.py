"""Worker load against sidecars that share a tier: reads, lookups and puts, timed and checked.

Each client thread uses the real worker client (`StoreClient`), so a fault is what a
worker sees: a miss. A read counts as missed unless it returns the exact payload; a
put as failed unless acked. Owns the load loop and its statistics only.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvsplice.common.keys import root_key
from kvsplice.common.segment import SegmentMeta, chained_meta
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig
from kvsplice.storeclient.wire import with_payload_digest

OPS = ("get", "lookup", "put")
Segment = tuple[SegmentMeta, bytes]


@dataclass
class OpStats:
    """Latencies of one operation; `num_bad` = failed or missed."""

    latencies_s: list[float] = field(default_factory=list)
    num_bad: int = 0
    slowest_put_s: float = 0.0

    def summary(self, duration_s: float) -> dict[str, float]:
        ordered = sorted(self.latencies_s)
        count = len(ordered)

        def pct(q: float) -> float:
            return 1000 * ordered[min(count - 1, int(q * count))] if count else 0.0

        return {
            "count": count,
            "failed_or_missed": self.num_bad,
            "per_s": round(count / duration_s, 1) if duration_s else 0.0,
            "p50_ms": round(pct(0.50), 2),
            "p99_ms": round(pct(0.99), 2),
            "max_ms": round(1000 * ordered[-1], 2) if count else 0.0,
        }


def make_segment(
    namespace: str, fingerprint: str, parent: bytes | None, position: int, rng: random.Random,
    num_tokens: int, nbytes: int,
) -> Segment:  # fmt: skip
    tokens = tuple(rng.randrange(1, 50_000) for _ in range(num_tokens))
    payload = rng.randbytes(nbytes)
    parent_key = root_key(fingerprint) if parent is None else parent
    meta = chained_meta(namespace, fingerprint, parent_key, tokens, position, 4)
    return with_payload_digest(meta, payload), payload


def make_chain(
    namespace: str, fingerprint: str, num_segments: int, num_tokens: int, nbytes: int, seed: int
) -> list[Segment]:
    rng, chain, parent = random.Random(seed), [], None
    for i in range(num_segments):
        meta, payload = make_segment(
            namespace, fingerprint, parent, i * num_tokens, rng, num_tokens, nbytes
        )
        chain.append((meta, payload))
        parent = meta.context_key
    return chain


@dataclass(frozen=True)
class LoadSpec:
    """`mix` weights get/lookup/put; reads pick from `read_set`, puts write new roots."""

    targets: tuple[str, ...]
    namespace: str
    fingerprint: str
    read_set: tuple[Segment, ...]
    num_clients: int = 1
    mix: tuple[float, float, float] = (0.6, 0.2, 0.2)
    put_nbytes: int = 16 * 1024
    num_tokens: int = 16


class LoadRun:
    """Runs `spec` on threads from `start()` to `stop()`; `stats` and `written` after."""

    def __init__(self, spec: LoadSpec, seed: int = 0) -> None:
        self.spec = spec
        self.stats = {op: OpStats() for op in OPS}
        self.written: list[Segment] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seed = seed
        self._threads: list[threading.Thread] = []
        self._started_s = 0.0
        self.duration_s = 0.0

    def start(self) -> LoadRun:
        self._started_s = time.monotonic()
        for i in range(self.spec.num_clients):
            thread = threading.Thread(target=self._work, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> LoadRun:
        self._stop.set()
        for thread in self._threads:
            thread.join()
        self.duration_s = time.monotonic() - self._started_s
        return self

    def summary(self) -> dict[str, dict[str, float]]:
        return {op: self.stats[op].summary(self.duration_s) for op in OPS}

    def _work(self, index: int) -> None:
        spec = self.spec
        rng = random.Random(self._seed * 1000 + index)
        config = StoreClientConfig(lookup_timeout_s=2.0, get_timeout_s=5.0, put_timeout_s=5.0)
        target = spec.targets[index % len(spec.targets)]
        tokens = [t for meta, _ in spec.read_set for t in meta.token_ids]
        with StoreClient(target, spec.namespace, config=config) as client:
            while not self._stop.is_set():
                op = rng.choices(OPS, weights=spec.mix)[0]
                started = time.monotonic()
                ok = self._one(client, op, rng, tokens)
                self._record(op, time.monotonic() - started, ok)

    def _one(self, client: StoreClient, op: str, rng: random.Random, tokens: list[int]) -> bool:
        spec = self.spec
        if op == "get":
            meta, payload = rng.choice(spec.read_set)
            read = client.get_segment(meta.context_key)
            return read is not None and read[1] == payload
        if op == "lookup":
            match = client.lookup_prefix(spec.fingerprint, tokens)
            return match.num_matched_tokens == len(tokens)
        segment = make_segment(
            spec.namespace, spec.fingerprint, None, 0, rng, spec.num_tokens, spec.put_nbytes
        )
        acked = client.put_segment(*segment)
        if acked:
            with self._lock:
                self.written.append(segment)
        return acked

    def _record(self, op: str, seconds: float, ok: bool) -> None:
        with self._lock:
            stats = self.stats[op]
            stats.latencies_s.append(seconds)
            stats.num_bad += not ok


def read_back(targets: Sequence[str], namespace: str, segments: Sequence[Segment]) -> int:
    """How many of `segments` some target does NOT return byte-identical (0 is the goal)."""
    num_bad = 0
    clients = [StoreClient(target, namespace) for target in targets]
    try:
        for i, (meta, payload) in enumerate(segments):
            read = clients[i % len(clients)].get_segment(meta.context_key)
            num_bad += read is None or read[1] != payload
    finally:
        for client in clients:
            client.close()
    return num_bad
