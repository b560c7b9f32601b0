"""Reported reuse is kept with the tiers: a restart on the same LMDB shows the same counts
(exact and approximate apart), a SIGKILL loses at most the last `persist_interval_s`, and a
write the store refuses is tried again."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest
from helpers.serve_process import ServeProcess, start_serve
from helpers.store import NAMESPACE, make_meta, make_payload

from kvsplice.common.errors import ResourceExhausted
from kvsplice.common.reuse_report import ReusedRun
from kvsplice.server.config import ServerConfig
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.server.reported_reuse import ReportedReuse, report_counts
from kvsplice.storeclient.client import StoreClient

IDLE = "team-idle"  # reports, but stores nothing


def report(target: str, num_calls: int) -> bytes:
    """Store one segment in NAMESPACE, then report `num_calls` calls of 10 prompt tokens
    that reused 4 of it in place, 3 of them approximate; IDLE's call reused nothing."""
    payload = make_payload(2000, seed=num_calls)
    meta = make_meta((num_calls, 1, 2, 3), payload)
    with StoreClient(target, NAMESPACE) as client:
        assert client.put_segment(meta, payload)
        for _ in range(num_calls):
            client.report_reuse(
                10, [ReusedRun(1, "in_place", meta.context_key),
                     ReusedRun(3, "in_place", meta.context_key, exact=False)],
            )  # fmt: skip
        assert client.flush_reports()
    with StoreClient(target, IDLE) as client:
        client.report_reuse(5)
        assert client.flush_reports()
    return meta.context_key


def rows(admin_url: str) -> dict[str, dict]:
    reply = httpx.get(f"{admin_url}/v1/stats").json()["namespaces"]
    return {row["namespace"]: row for row in reply}


def reported(row: dict) -> tuple:
    return (
        row["num_calls"], row["num_requested_tokens"], row["num_hit_tokens"],
        row["num_approximate_hit_tokens"], row["hit_tokens_by_source"]["in_place"],
    )  # fmt: skip


def embedded(path: Path, **overrides: object) -> ServerConfig:
    return loopback_config(str(path), admin_port=0, **overrides)


def test_a_restart_on_the_same_lmdb_shows_the_same_counts(tmp_path: Path) -> None:
    with EmbeddedStore(embedded(tmp_path)) as store:
        report(store.target, num_calls=3)
        before = rows(str(store.admin_url))
    assert reported(before[NAMESPACE]) == (3, 30, 12, 9, 12)
    assert reported(before[IDLE]) == (1, 5, 0, 0, 0)
    with EmbeddedStore(embedded(tmp_path)) as store:
        after = rows(str(store.admin_url))
        report(store.target, num_calls=1)  # counting goes on from there
        again = rows(str(store.admin_url))
    assert {ns: reported(r) for ns, r in after.items()} == {
        ns: reported(r) for ns, r in before.items()
    }
    assert after[NAMESPACE]["hit_rate"] == before[NAMESPACE]["hit_rate"] == pytest.approx(0.4)
    assert after[NAMESPACE]["exact_hit_rate"] == pytest.approx(0.1)
    assert reported(again[NAMESPACE]) == (4, 40, 16, 12, 16)


def test_counts_are_written_on_the_cadence_while_serving(tmp_path: Path) -> None:
    with EmbeddedStore(embedded(tmp_path, persist_interval_s=0.1)) as store:
        report(store.target, num_calls=2)
        deadline = time.monotonic() + 30
        kept: dict[str, dict[str, int]] = {}
        while NAMESPACE not in kept and time.monotonic() < deadline:
            time.sleep(0.05)
            kept = store.server.store.counters.load()
        assert kept[NAMESPACE]["num_calls"] == 2
        assert kept[NAMESPACE]["num_approximate_hit_tokens"] == 6


def start(workdir: Path, lmdb: Path) -> ServeProcess:
    return start_serve(workdir, "--lmdb-path", str(lmdb), "--memory-mib", "0")


def test_a_sigkill_loses_at_most_the_last_interval(tmp_path: Path) -> None:
    lmdb = tmp_path / "lmdb"
    first = start(tmp_path / "a", lmdb)
    try:
        report(first.target, num_calls=2)
        time.sleep(ServerConfig().persist_interval_s + 3)  # written on the cadence since
        report(first.target, num_calls=1)  # perhaps not yet written
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
    finally:
        first.process.kill()
    second = start(tmp_path / "b", lmdb)
    try:
        row = rows(str(second.admin_url))[NAMESPACE]
        assert reported(row) in {(2, 20, 8, 6, 8), (3, 30, 12, 9, 12)}
    finally:
        assert second.stop() == 0


class RefusingOnce:
    """`CounterRecords` whose first save finds the store full."""

    def __init__(self) -> None:
        self.saved: list[dict] = []

    def load(self) -> dict:
        return {}

    def save(self, counts: dict) -> None:
        if not self.saved:
            self.saved.append({})
            raise ResourceExhausted("full")
        self.saved.append(dict(counts))


def test_a_refused_write_is_tried_again() -> None:
    from kvsplice.common.reuse_report import ReuseReport

    records = RefusingOnce()
    totals = ReportedReuse(records)  # type: ignore[arg-type]
    one = ReuseReport(1, 10, {"grpc": 4}, num_approximate_hit_tokens=4)
    totals.add("team-a", one)
    asyncio.run(totals.persist())  # refused: kept for the next write
    asyncio.run(totals.persist())
    asyncio.run(totals.persist())  # nothing new: nothing written
    assert records.saved == [{}, {"team-a": report_counts(one)}]
