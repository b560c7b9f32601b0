"""Each store metric moves when its event happens in a live sidecar, read back from `/metrics`."""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import xxhash
from helpers.store import make_meta
from prometheus_client.parser import text_string_to_metric_families

from kvsplice.common.reuse_report import SERVED, ReusedRun
from kvsplice.common.segment import SegmentMeta
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storage.config import LMDBTierConfig
from kvsplice.storeclient.client import StoreClient

FINGERPRINT = "kvfp1-" + "0" * 32
NAMESPACE = "tenant-a"
MARKER = b"<<kvsplice-metrics-corruption-marker>>"
MIB = 1 << 20


def make_segment(i: int, nbytes: int, **fields: object) -> tuple[SegmentMeta, bytes]:
    payload = random.Random(i).randbytes(nbytes)
    tokens = (i, i + 1, i + 2, i + 3)
    meta = make_meta(tokens, payload, namespace=NAMESPACE, fingerprint=FINGERPRINT, **fields)
    return meta, payload


def start(path: Path, memory_mib: int = 1, lmdb_mib: int = 4) -> EmbeddedStore:
    config = loopback_config(str(path), memory_bytes=memory_mib * MIB, admin_port=0)
    lmdb = LMDBTierConfig(path=str(path), map_size_bytes=lmdb_mib * MIB, sync=False)
    # Puts cached in the memory tier too: these tests count each tier's hits and evictions.
    store_config = replace(config.store, lmdb=lmdb, cache_puts=True)
    store = EmbeddedStore(replace(config, store=store_config))
    store.start()
    return store


def scrape(store: EmbeddedStore) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{store.admin_url}/metrics").text
    assert "_created" not in text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(metrics: dict, name: str, **labels: str) -> float:
    return metrics[name, tuple(sorted(labels.items()))]


def field(panels: str, name: str) -> list[str]:
    """The text of every dashboard cell of `data-field` `name`."""
    return re.findall(rf'data-field="{name}"[^>]*>([^<]*)<', panels)


def tier_cells(panels: str, tier: str) -> list[str]:
    """The numeric cells of the tiers panel's row of `tier`."""
    row = re.search(rf'<tr data-tier="{tier}">(.*?)</tr>', panels)
    assert row is not None, panels
    return re.findall(r'<td class="num"[^>]*>([^<]*)</td>', row.group(1))


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[EmbeddedStore]:
    store = start(tmp_path)
    yield store
    store.stop()


def test_tier_requests_count_hits_and_misses_per_tier(sidecar: EmbeddedStore) -> None:
    before = scrape(sidecar)
    assert sample(before, "kvsplice_tier_requests_total", tier="memory", result="hit") == 0
    with StoreClient(sidecar.target, NAMESPACE) as client:
        metas = [make_segment(i, 300_000) for i in range(6)]  # 1.8 MB: the 1 MiB memory tier
        for meta, payload in metas:  # keeps the last three
            assert client.put_segment(meta, payload)
        for meta, _ in reversed(metas):  # newest first: memory hits, then LMDB hits
            assert client.get_segment(meta.segment_id) is not None
    after = scrape(sidecar)
    assert sample(after, "kvsplice_tier_requests_total", tier="memory", result="hit") >= 1
    assert sample(after, "kvsplice_tier_requests_total", tier="memory", result="miss") >= 1
    assert sample(after, "kvsplice_tier_requests_total", tier="lmdb", result="hit") >= 1


def test_evictions_count_by_tier_and_reason(sidecar: EmbeddedStore) -> None:
    with StoreClient(sidecar.target, NAMESPACE) as client:
        for i in range(24):  # 24 x 400 KB into a 4 MiB LMDB (the scenario)
            meta, payload = make_segment(i, 400_000)
            assert client.put_segment(meta, payload)
        meta, payload = make_segment(99, 1000, ttl_s=0.05)
        assert client.put_segment(meta, payload)
        time.sleep(0.2)
        assert client.get_segment(meta.segment_id) is None  # read after expiry: removed
    metrics = scrape(sidecar)
    assert sample(metrics, "kvsplice_evictions_total", tier="lmdb", reason="capacity") >= 10
    assert sample(metrics, "kvsplice_evictions_total", tier="memory", reason="capacity") >= 10
    assert sample(metrics, "kvsplice_evictions_total", tier="lmdb", reason="ttl") == 1
    assert sample(metrics, "kvsplice_segments") < 24


def test_checksum_failures_count_bytes_flipped_on_disk(tmp_path: Path) -> None:
    store = start(tmp_path)
    meta, payload = make_segment(1, 50_000)
    payload = payload[:20_000] + MARKER + payload[20_000 + len(MARKER) :]
    meta = replace(meta, checksum=xxhash.xxh3_64_intdigest(payload))
    with StoreClient(store.target, NAMESPACE) as client:
        assert client.put_segment(meta, payload)
    store.stop()
    data_file = tmp_path / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    raw[raw.index(MARKER) + 5] ^= 0xFF
    data_file.write_bytes(bytes(raw))

    store = start(tmp_path)  # a fresh memory tier: the read goes to LMDB
    try:
        assert sample(scrape(store), "kvsplice_checksum_failures_total", tier="lmdb") == 0
        with StoreClient(store.target, NAMESPACE) as client:
            assert client.get_segment(meta.segment_id) is None  # a miss, never the bad bytes
        metrics = scrape(store)
        assert sample(metrics, "kvsplice_checksum_failures_total", tier="lmdb") == 1
        assert sample(metrics, "kvsplice_evictions_total", tier="lmdb", reason="lost") == 1
    finally:
        store.stop()


def test_tier_bytes_against_capacity(sidecar: EmbeddedStore) -> None:
    empty = scrape(sidecar)
    with StoreClient(sidecar.target, NAMESPACE) as client:
        meta, payload = make_segment(1, 200_000)
        assert client.put_segment(meta, payload)
    metrics = scrape(sidecar)
    assert sample(metrics, "kvsplice_tier_capacity_bytes", tier="memory") == 1 * MIB
    assert sample(metrics, "kvsplice_tier_capacity_bytes", tier="lmdb") == 4 * MIB
    for tier in ("memory", "lmdb"):
        used = sample(metrics, "kvsplice_tier_used_bytes", tier=tier)
        assert used - sample(empty, "kvsplice_tier_used_bytes", tier=tier) >= 200_000
    assert sample(metrics, "kvsplice_stored_bytes") >= 200_000


def test_token_hit_rate_is_what_workers_reported_everywhere(sidecar: EmbeddedStore) -> None:
    stored, _ = make_segment(0, 1000)
    unknown, _ = make_segment(9, 1000)  # never stored: its reads are not counted
    with StoreClient(sidecar.target, NAMESPACE) as client:
        assert client.put_segment(*make_segment(0, 1000))
        client.lookup_prefix(FINGERPRINT, [0, 1, 2, 3, 7, 7, 7, 7])  # index coverage only
        client.report_reuse(8, [ReusedRun(4, "local", stored.context_key)])
        client.report_reuse(
            14,
            [
                ReusedRun(4, "in_place", stored.context_key),
                ReusedRun(3, "grpc"),
                ReusedRun(2, "local", unknown.context_key),
                # the same tokens computed after another prefix, moved here: approximate
                ReusedRun(2, "in_place", stored.context_key, exact=False),
            ],
        )
        client.report_reuse(6)  # a call that reused nothing
        assert client.flush_reports()
        assert client.counters.num_reports_sent == 1  # three calls, one RPC
    metrics = scrape(sidecar)
    assert sample(metrics, "kvsplice_prompt_tokens_total") == 28
    hit = {s: sample(metrics, "kvsplice_hit_tokens_total", served=s) for s in SERVED}
    assert hit == {"local": 6, "in_place": 6, "grpc": 3}
    assert sample(metrics, "kvsplice_approximate_hit_tokens_total") == 2  # of the 15, not all
    assert sample(metrics, "kvsplice_reported_calls_total") == 3
    assert sample(metrics, "kvsplice_lookup_queried_tokens_total") == 8
    (row,) = httpx.get(f"{sidecar.admin_url}/v1/stats").json()["namespaces"]
    assert (row["num_requested_tokens"], row["num_hit_tokens"], row["num_calls"]) == (28, 15, 3)
    assert (row["num_approximate_hit_tokens"], row["num_exact_hit_tokens"]) == (2, 13)
    assert row["hit_tokens_by_source"] == hit
    assert row["hit_rate"] == pytest.approx(15 / 28)
    assert row["exact_hit_rate"] == pytest.approx(13 / 28)
    panels = httpx.get(f"{sidecar.admin_url}/dashboard/panels").text
    top = panels.split('id="top"')[1]
    assert stored.segment_id in top and unknown.segment_id not in top
    # read locally once and in place twice: the sidecar served none of those reads itself
    assert re.search(rf"{stored.segment_id}</code></td>(<td[^>]*>[^<]*</td>){{2}}"
                     r'<td class="num">3</td>', top)  # fmt: skip
    assert "15 / 28" in panels
    assert field(panels, "approximate_tokens") == ["2"]
    assert field(panels, "exact_hit_rate") == [f"{100 * 13 / 28:.1f}%"]
    # the LMDB map was read in place twice (reported); the memory tier cannot be
    assert tier_cells(panels, "lmdb")[-1] == "2" and tier_cells(panels, "memory")[-1] == "-"


def test_build_info_and_process_metrics(sidecar: EmbeddedStore) -> None:
    metrics = scrape(sidecar)
    (build,) = [labels for name, labels in metrics if name == "kvsplice_build_info"]
    assert dict(build)["version"] not in ("", "unknown")
    assert sample(metrics, "process_resident_memory_bytes") > 10 * MIB
    assert sample(metrics, "process_open_fds") > 0
