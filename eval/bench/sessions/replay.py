"""The trace replayed into the real store: the sidecar's `SegmentService` over a memory tier and
an LMDB tier at the bench's budgets, driven on the trace's clock, as the servicer drives it.

Each request looks up its prompt's stored prefix (a session's request holds what it matched,
renewing its lease), reads the hits through the tiers, puts the chunks it missed (held by its
session) and, at a pipeline's last call, sends the release hint. Without `sessions` no session
id is sent: the store evicts exactly as it does today.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvsplice.common.keys import root_key
from kvsplice.common.segment import chained_meta
from kvsplice.eval.bench.sessions.config import SessionBenchConfig
from kvsplice.eval.bench.sessions.trace import TraceRequest
from kvsplice.index.exact_index import ExactIndex
from kvsplice.index.similarity_index import SimilarityIndex
from kvsplice.server.config import SegmentServiceConfig
from kvsplice.server.segment_service import SegmentService
from kvsplice.storage.config import (
    LMDBTierConfig,
    MemoryTierConfig,
    RetentionRules,
    SessionConfig,
    StoreConfig,
    build_store,
)
from kvsplice.storage.segment_codec import payload_digest

NAMESPACE = "agents"
FINGERPRINT = "kvfp1-" + "5e" * 16
VOCAB = 32_000


@dataclass
class TraceClock:
    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s


@dataclass(frozen=True)
class ServedRequest:
    request: TraceRequest
    num_hit_tokens: int
    num_prompt_tokens: int


@dataclass
class ReplayResult:
    served: list[ServedRequest] = field(default_factory=list)
    chunk_keys: list[tuple[bytes, ...]] = field(default_factory=list)  # per request, in order
    max_num_segments: int = 0  # the most chunks the store held at once: its capacity
    tier_hits: dict[str, int] = field(default_factory=dict)
    removals: dict[str, int] = field(default_factory=dict)
    max_live_sessions: int = 0


def block_tokens(block: str, num_tokens: int) -> tuple[int, ...]:
    seed = zlib.crc32(block.encode())
    return tuple((seed + 7919 * i) % VOCAB for i in range(num_tokens))


def replay(
    config: SessionBenchConfig,
    trace: Sequence[TraceRequest],
    sessions: bool,
    lmdb_dir: str,
    rules: RetentionRules | None = None,
) -> ReplayResult:
    """Replay `trace` into a fresh store in `lmdb_dir`; with `sessions`, session ids and hints
    (`rules`: the store's retention rules, all of them by default)."""
    clock = TraceClock()
    session_config = SessionConfig(lease_s=config.lease_s, max_lease_s=config.lease_s)
    if rules is not None:
        session_config = replace(session_config, rules=rules)
    store_config = StoreConfig(
        memory=MemoryTierConfig(max_bytes=config.memory_bytes),
        lmdb=LMDBTierConfig(path=lmdb_dir, map_size_bytes=config.lmdb_bytes, sync=False),
        sessions=session_config,
    )
    store = build_store(store_config, clock=clock)
    service = SegmentService(store, ExactIndex(), SimilarityIndex(), SegmentServiceConfig())
    payload = os.urandom(2 * config.chunk_nbytes)
    result = ReplayResult()
    try:
        for request in trace:
            clock.now_s = request.time_s
            session_id = request.session_id if sessions else None
            result.served.append(_serve(config, service, request, session_id, payload, result))
            usage = store.namespace_usage().get(NAMESPACE)
            result.max_num_segments = max(result.max_num_segments, usage.segments if usage else 0)
            result.max_live_sessions = max(result.max_live_sessions, service.sessions.num_live())
        stats = store.stats()
        result.tier_hits = {name: tier.hits for name, tier in stats.tiers.items()}
        result.removals = dict(stats.removals)
    finally:
        store.close()
    return result


def _serve(
    config: SessionBenchConfig,
    service: SegmentService,
    request: TraceRequest,
    session_id: str | None,
    payload: bytes,
    result: ReplayResult,
) -> ServedRequest:
    chunks = [block_tokens(block, config.chunk_tokens) for block in request.blocks]
    tokens = [token for chunk in chunks for token in chunk]
    match = service.lookup_prefix(NAMESPACE, FINGERPRINT, tokens)
    hits = [meta.context_key for meta in match.segments]
    if session_id is not None:
        service.sessions.hold(NAMESPACE, session_id, hits)
    for key in hits:
        service.fetch(NAMESPACE, key)  # the load: read through the tiers
    keys = list(hits)
    parent = hits[-1] if hits else root_key(FINGERPRINT)
    for index in range(len(hits), len(chunks)):
        key = _put(config, service, chunks[index], index, parent, payload)
        if session_id is not None:
            service.sessions.hold(NAMESPACE, session_id, [key])
        keys.append(parent := key)
    if session_id is not None and request.release:
        service.sessions.end(NAMESPACE, session_id)
    result.chunk_keys.append(tuple(keys))
    return ServedRequest(request, match.num_matched_tokens, len(tokens))


def _put(
    config: SessionBenchConfig,
    service: SegmentService,
    tokens: tuple[int, ...],
    index: int,
    parent: bytes,
    payload: bytes,
) -> bytes:
    nbytes = config.chunk_nbytes
    offset = zlib.crc32(parent) % nbytes
    body = payload[offset : offset + nbytes]
    meta = chained_meta(
        NAMESPACE, FINGERPRINT, parent, tokens, index * config.chunk_tokens, 1,
        payload_nbytes=nbytes, checksum=payload_digest(body), created_at_s=0.0,
    )  # fmt: skip
    service.index(service.write(meta, body))
    return meta.context_key


def temporary_dir(config: SessionBenchConfig) -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="kvsplice-sessions-", dir=config.tmp_dir)
