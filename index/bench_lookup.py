"""Lookup latency of the exact and similarity indexes on synthetic segments.

Builds deterministic chains of segments (random token ids, pseudo-word text
with volatile numbers) and times `add` and queries; it prints nothing (the
CLI renders `LatencyReport`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from kvsplice.common.keys import root_key
from kvsplice.common.segment import SegmentMeta, chained_meta
from kvsplice.index.exact_index import ExactIndex
from kvsplice.index.similarity_index import SimilarityConfig, SimilarityIndex

logger = logging.getLogger(__name__)

BENCH_NAMESPACE = "bench"
BENCH_FINGERPRINT = "kvfp1-" + "0" * 32
_VOCAB_SIZE = 32_000
_TOKENS_PER_WORD = 1.33
_SYLLABLES = ("ka", "lo", "mi", "re", "tu", "sa", "ne", "po", "vi", "da", "go", "fe")


@dataclass(frozen=True)
class LatencyReport:
    """One index kind at one size. `adds_per_s` is the rebuild rate from bare
    metadata; `signed_adds_per_s` (similarity only, else 0) from persisted signatures.
    `cpu_*` are this thread's CPU time per query: on a shared host they exclude
    preemption, which inflates the wall-clock `p99_ms`."""

    kind: str
    num_segments: int
    segment_tokens: int
    with_text: bool
    num_queries: int
    adds_per_s: float
    signed_adds_per_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float
    cpu_p50_ms: float
    cpu_p99_ms: float
    hit_rate: float


@dataclass(frozen=True)
class _Workload:
    metas: list[SegmentMeta]
    chains: list[list[SegmentMeta]]


def _pseudo_words(rng: np.random.Generator, num_words: int) -> list[str]:
    syllables = rng.integers(0, len(_SYLLABLES), size=(num_words, 3))
    return ["".join(_SYLLABLES[s] for s in row) for row in syllables]


def _segment_text(rng: np.random.Generator, vocabulary: list[str], num_tokens: int) -> str:
    """Pseudo-words with a volatile number every ~16 words (masked by canonicalization)."""
    picks = rng.integers(0, len(vocabulary), size=int(num_tokens / _TOKENS_PER_WORD))
    words = [vocabulary[i] for i in picks]
    for slot in range(0, len(words), 16):
        words[slot] = f"id={int(rng.integers(0, 10**6))}"
    return " ".join(words)


def make_workload(
    num_segments: int,
    *,
    segment_tokens: int = 128,
    segments_per_chain: int = 4,
    with_text: bool = True,
    seed: int = 0,
) -> _Workload:
    """Deterministic chains of `segments_per_chain` segments laid from position 0."""
    rng = np.random.default_rng(seed)
    token_objects = list(range(_VOCAB_SIZE))  # shared int objects keep 100k tuples small
    vocabulary = _pseudo_words(rng, 4096)
    metas: list[SegmentMeta] = []
    chains: list[list[SegmentMeta]] = []
    while len(metas) < num_segments:
        chain_len = min(segments_per_chain, num_segments - len(metas))
        ids = rng.integers(0, _VOCAB_SIZE, size=chain_len * segment_tokens).tolist()
        tokens = tuple(token_objects[i] for i in ids)
        chain = _make_chain(tokens, segment_tokens, with_text, rng, vocabulary)
        chains.append(chain)
        metas.extend(chain)
    return _Workload(metas, chains)


def _make_chain(
    tokens: tuple[int, ...],
    segment_tokens: int,
    with_text: bool,
    rng: np.random.Generator,
    vocabulary: list[str],
) -> list[SegmentMeta]:
    parent = root_key(BENCH_FINGERPRINT)
    chain = []
    for start in range(0, len(tokens), segment_tokens):
        span = tokens[start : start + segment_tokens]
        text = _segment_text(rng, vocabulary, segment_tokens) if with_text else ""
        meta = chained_meta(
            BENCH_NAMESPACE, BENCH_FINGERPRINT, parent, span, start, 30,
            left_tail_ids=tokens[max(0, start - 256) : start], index_text=text,
        )  # fmt: skip
        chain.append(meta)
        parent = meta.context_key
    return chain


def _percentiles(samples_s: Sequence[float]) -> tuple[float, float, float]:
    ms = np.asarray(samples_s) * 1e3
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), float(ms.max())


def _time_queries(
    queries: Sequence[Callable[[], bool]],
) -> tuple[list[float], list[float], float]:
    """Wall-clock and thread-CPU seconds of each query, and the hit rate."""
    wall_s, cpu_s, hits = [], [], 0
    for query in queries:
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        hit = query()
        cpu_s.append(time.thread_time() - cpu_start)
        wall_s.append(time.perf_counter() - wall_start)
        hits += hit
    return wall_s, cpu_s, hits / max(1, len(queries))


def _time_adds(add: Callable[[SegmentMeta], None], metas: Sequence[SegmentMeta]) -> float:
    start = time.perf_counter()
    for meta in metas:
        add(meta)
    return len(metas) / max(time.perf_counter() - start, 1e-9)


def measure_lookup_latency(
    num_segments: int,
    *,
    kind: str = "similarity",
    segment_tokens: int = 128,
    with_text: bool = True,
    num_queries: int = 1000,
    measure_signed_rebuild: bool = False,
    similarity_config: SimilarityConfig | None = None,
    seed: int = 0,
) -> LatencyReport:
    """Build one index over `num_segments` synthetic segments and time queries.

    exact: each query is a stored chain plus unknown trailing tokens (a hit
    covers the chain). similarity: a stored segment with its text's numbers
    changed, every other one with 3 token ids changed too (a hit returns it).
    """
    if kind not in ("exact", "similarity"):
        raise ValueError(f"kind {kind!r} must be 'exact' or 'similarity'")
    if num_segments < 1 or num_queries < 1:
        raise ValueError(f"num_segments {num_segments} and num_queries {num_queries} must be >= 1")
    workload = make_workload(
        num_segments, segment_tokens=segment_tokens, with_text=with_text, seed=seed
    )
    rng = np.random.default_rng(seed + 1)
    if kind == "exact":
        adds_per_s, signed_adds_per_s, queries = _exact_case(workload, rng, num_queries)
    else:
        config = similarity_config or SimilarityConfig()
        adds_per_s, signed_adds_per_s, queries = _similarity_case(
            workload, rng, num_queries, config, measure_signed_rebuild
        )
    wall_s, cpu_s, hit_rate = _time_queries(queries)
    p50_ms, p99_ms, max_ms = _percentiles(wall_s)
    cpu_p50_ms, cpu_p99_ms, _ = _percentiles(cpu_s)
    return LatencyReport(
        kind=kind,
        num_segments=num_segments,
        segment_tokens=segment_tokens,
        with_text=with_text,
        num_queries=num_queries,
        adds_per_s=adds_per_s,
        signed_adds_per_s=signed_adds_per_s,
        p50_ms=p50_ms,
        p99_ms=p99_ms,
        max_ms=max_ms,
        cpu_p50_ms=cpu_p50_ms,
        cpu_p99_ms=cpu_p99_ms,
        hit_rate=hit_rate,
    )


def _exact_case(
    workload: _Workload, rng: np.random.Generator, num_queries: int
) -> tuple[float, float, list[Callable[[], bool]]]:
    index = ExactIndex()
    adds_per_s = _time_adds(index.add, workload.metas)
    queries: list[Callable[[], bool]] = []
    for chain_id in rng.integers(0, len(workload.chains), size=num_queries).tolist():
        chain = workload.chains[chain_id]
        prompt = [t for meta in chain for t in meta.token_ids]
        prompt += rng.integers(0, _VOCAB_SIZE, size=32).tolist()
        queries.append(partial(_exact_query, index, prompt, chain[-1].end_position))
    return adds_per_s, 0.0, queries


def _exact_query(index: ExactIndex, prompt: list[int], expected_num_tokens: int) -> bool:
    match = index.lookup_prefix(BENCH_NAMESPACE, BENCH_FINGERPRINT, prompt)
    return match.num_matched_tokens == expected_num_tokens


def _similarity_case(
    workload: _Workload,
    rng: np.random.Generator,
    num_queries: int,
    config: SimilarityConfig,
    measure_signed_rebuild: bool,
) -> tuple[float, float, list[Callable[[], bool]]]:
    index = SimilarityIndex(config)
    adds_per_s = _time_adds(index.add, workload.metas)
    signed_adds_per_s = _signed_rebuild_rate(index, workload) if measure_signed_rebuild else 0.0
    queries: list[Callable[[], bool]] = []
    picks = rng.integers(0, len(workload.metas), size=num_queries).tolist()
    for query_id, meta_id in enumerate(picks):
        meta = workload.metas[meta_id]
        tokens = list(meta.token_ids)
        if query_id % 2:
            for slot in rng.integers(0, len(tokens), size=3).tolist():
                tokens[slot] = int(rng.integers(0, _VOCAB_SIZE))
        text = " ".join(_renumber(word, rng) for word in meta.index_text.split(" "))
        queries.append(partial(_similarity_query, index, meta, tokens, text))
    return adds_per_s, signed_adds_per_s, queries


def _similarity_query(
    index: SimilarityIndex, target: SegmentMeta, token_ids: list[int], text: str
) -> bool:
    found = index.find_similar(
        BENCH_NAMESPACE,
        BENCH_FINGERPRINT,
        token_ids,
        text=text,
        left_context_ids=target.left_tail_ids,
    )
    return any(match.meta.context_key == target.context_key for match in found)


def _renumber(word: str, rng: np.random.Generator) -> str:
    return f"id={int(rng.integers(0, 10**6))}" if word.startswith("id=") else word


def _signed_rebuild_rate(index: SimilarityIndex, workload: _Workload) -> float:
    """Rebuild rate of a fresh index from signatures persisted beside the segments."""
    signatures = {meta.context_key: index.signature(meta) for meta in workload.metas}
    rebuilt = SimilarityIndex(index.config)
    return _time_adds(lambda meta: rebuilt.add(meta, signatures[meta.context_key]), workload.metas)
