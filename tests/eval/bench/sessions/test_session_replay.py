"""A reduced `kvsplice bench sessions`: the same pipelines trace replayed into the real store
(memory over LMDB) with sessions beats today's eviction and stays under Belady's optimum; with
lease renewal disabled, or eviction blind to sessions, the advantage is gone (the oracle can
fail); the retention rules beside the lease add hits of their own. Belady's optimum itself is checked against brute force on tiny traces."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from kvsplice.common.config_flags import MIB
from kvsplice.eval.bench.sessions.belady import belady
from kvsplice.eval.bench.sessions.config import SessionBenchConfig
from kvsplice.eval.bench.sessions.replay import ReplayResult, replay
from kvsplice.eval.bench.sessions.trace import build_trace
from kvsplice.storage.config import RetentionRules
from kvsplice.storage.sessions import SessionLeases

CONFIG = SessionBenchConfig(
    num_sessions=48, concurrency=16, lease_s=60.0, memory_bytes=1 * MIB, lmdb_bytes=6 * MIB,
    sweep_lmdb_mib=(),
)  # fmt: skip
TRACE = build_trace(CONFIG)
NO_RULE = RetentionRules(
    tails_first=False, leaves_first=False, reused_last=False, forecast=False, max_remembered=0
)


def hits(result: ReplayResult) -> int:
    return sum(served.num_hit_tokens for served in result.served)


def advantage(sessions: ReplayResult, today: ReplayResult) -> bool:
    """The oracle: sessions hit at least 25% more tokens than today's eviction (1.31x here;
    1.15x without lease renewal, 1.24x with the lease but none of the retention rules)."""
    return hits(sessions) >= 1.25 * hits(today)


@pytest.fixture(scope="module")
def today(tmp_path_factory: pytest.TempPathFactory) -> ReplayResult:
    return replay(CONFIG, TRACE, False, str(tmp_path_factory.mktemp("today")))


def with_sessions(tmp_path: Path, rules: RetentionRules | None = None) -> ReplayResult:
    return replay(CONFIG, TRACE, True, str(tmp_path / "sessions"), rules)


def test_sessions_beat_today_and_stay_under_the_optimum(today, tmp_path: Path) -> None:
    sessions = with_sessions(tmp_path)
    capacity = max(today.max_num_segments, sessions.max_num_segments)
    optimum = belady(today.chunk_keys, capacity).num_hits * CONFIG.chunk_tokens
    assert sessions.chunk_keys == today.chunk_keys  # one trace, the same accesses
    assert advantage(sessions, today), (hits(sessions), hits(today))
    assert hits(sessions) <= optimum
    assert hits(sessions) >= 0.9 * optimum, (hits(sessions), optimum)


def test_the_retention_rules_add_hits_to_the_lease(tmp_path: Path) -> None:
    """Every rule against none (the lease alone): 1.06x the hits here."""
    every = with_sessions(tmp_path / "every")
    lease_only = with_sessions(tmp_path / "lease", NO_RULE)
    assert hits(every) >= 1.03 * hits(lease_only), (hits(every), hits(lease_only))


def test_without_lease_renewal_the_advantage_is_gone(today, tmp_path, monkeypatch) -> None:
    """Negative control: a lease that only its first request sets runs out mid-pipeline."""
    renew = SessionLeases._renew

    def first_only(self: SessionLeases, ref, session, lease_s: float) -> None:
        if session.expires_at_s == 0.0:
            renew(self, ref, session, lease_s)

    monkeypatch.setattr(SessionLeases, "_renew", first_only)
    assert not advantage(with_sessions(tmp_path), today)


def test_eviction_blind_to_sessions_is_today_s(today, tmp_path, monkeypatch) -> None:
    """Negative control: holds kept, but eviction in plain LRU order."""
    monkeypatch.setattr(SessionLeases, "eviction_order", lambda self, keys, in_scope: keys)
    blind = with_sessions(tmp_path)
    assert not advantage(blind, today)
    assert hits(blind) == hits(today)


def brute_force_optimum(requests: list[list[str]], capacity: int) -> int:
    """The most hits any sequence of keep/evict choices achieves (exhaustive, tiny traces)."""
    best = 0

    def walk(position: int, cached: frozenset[str], num_hits: int) -> None:
        nonlocal best
        flat = [key for request in requests for key in request]
        if position == len(flat):
            best = max(best, num_hits)
            return
        key = flat[position]
        if key in cached:
            walk(position + 1, cached, num_hits + 1)
            return
        walk(position + 1, cached, num_hits)  # bypass
        if len(cached) < capacity:
            walk(position + 1, cached | {key}, num_hits)
        else:
            for victim in cached:
                walk(position + 1, (cached - {victim}) | {key}, num_hits)

    walk(0, frozenset(), 0)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_belady_equals_the_brute_force_optimum(seed: int) -> None:
    keys = "abcde"
    rng = random.Random(seed)
    requests = [[rng.choice(keys) for _ in range(rng.randint(1, 3))] for _ in range(5)]
    for capacity in (1, 2, 3):
        assert belady(requests, capacity).num_hits == brute_force_optimum(requests, capacity)
    assert list(itertools.chain(*requests))  # non-trivial
