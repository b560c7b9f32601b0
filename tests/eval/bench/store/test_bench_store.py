"""`bench store`: row arithmetic, configs, JSON round trip, and one tiny end-to-end run.

No timing assertions: the figures depend on the host; only their completeness is checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xxhash
from rich.console import Console

from kvsplice.common.keys import content_key, context_key, root_key
from kvsplice.eval.bench.store.bench import (
    LOOKUP_KINDS,
    MIB,
    TIERS,
    LookupRow,
    StoreBenchResult,
    TransferRow,
    run_store_bench,
    transfer_server_config,
)
from kvsplice.eval.bench.store.config import StoreBenchConfig
from kvsplice.eval.bench.store.paths import READ_PATHS, PathRow
from kvsplice.eval.bench.store.payloads import make_payload, make_segment_meta
from kvsplice.eval.bench.store.put_floor import PutFloorRow
from kvsplice.eval.bench.store.put_path import PutPathRow
from kvsplice.eval.bench.store.report import (
    render_store_bench,
    store_bench_from_json,
    store_bench_to_json,
)


def make_transfer_row(
    seconds: float = 0.01, copyto_seconds: float = 0.001, target_mb_s: float | None = 500.0
) -> TransferRow:
    return TransferRow("lmdb", "get", 8, seconds, copyto_seconds, target_mb_s)


def make_lookup_row(p99_ms: float = 0.8, target_p99_ms: float = 1.0) -> LookupRow:
    return LookupRow(
        path="grpc", kind="exact", num_segments=100_000, num_queries=1000, p50_ms=0.5,
        p99_ms=p99_ms, cpu_p50_ms=0.4, cpu_p99_ms=0.7, hit_rate=1.0,
        populated_via="LMDB preload + rebuild", populate_s=12.5, target_p99_ms=target_p99_ms,
    )  # fmt: skip


def make_result() -> StoreBenchResult:
    return StoreBenchResult(
        config=StoreBenchConfig(sizes_mib=(8,), lookup_counts=(100_000,), tmp_dir="/tmp/x"),
        transfers=(make_transfer_row(), make_transfer_row(target_mb_s=None)),
        lookups=(make_lookup_row(), make_lookup_row(p99_ms=1.5)),
        load_before=(1.0, 2.0, 3.0),
        load_after=(1.5, 2.5, 3.5),
        num_cpus=2,
        seconds=42.0,
        paths=(PathRow("same-host", 8, 0.001, 0.0008), PathRow("grpc", 8, 0.01, 0.0008)),
        put_path=(PutPathRow(8, 10, 0.004, 0.001, 0.02, 0.01, "fsync every 100 ms"),),
        put_path_load=(1.1, 2.1, 3.1),
        put_path_floor=(PutFloorRow(8, 10, 0.002, 0.005, 100.0),),
    )


def render_text(result: StoreBenchResult) -> str:
    console = Console(width=240, record=True)
    for renderable in render_store_bench(result):
        console.print(renderable)
    return console.export_text()


def test_transfer_row_figures_follow_from_seconds() -> None:
    row = make_transfer_row(seconds=0.01, copyto_seconds=0.001)
    assert row.mb_per_s == pytest.approx(8 * MIB / 1e6 / 0.01)
    assert row.ratio_to_copyto == pytest.approx(row.mb_per_s / row.copyto_mb_per_s)
    assert row.target_met is True  # 839 MB/s >= 500
    assert make_transfer_row(seconds=0.1).target_met is False
    assert make_transfer_row(target_mb_s=None).target_met is None


def test_path_targets_are_a_copy_ratio_same_host_and_mb_s_over_grpc() -> None:
    same_host = PathRow("same-host", 8, seconds=0.001, copyto_seconds=0.0008)
    assert same_host.ratio_to_copyto == pytest.approx(0.8) and same_host.target_met
    assert not PathRow("same-host", 8, seconds=0.002, copyto_seconds=0.0008).target_met
    grpc_row = PathRow("grpc", 8, seconds=0.01, copyto_seconds=0.0008)
    assert grpc_row.mb_per_s == pytest.approx(8 * MIB / 1e6 / 0.01) and not grpc_row.target_met
    assert PathRow("grpc", 8, seconds=0.008, copyto_seconds=0.0008).target_met


def test_lookup_target_is_an_upper_bound_on_p99() -> None:
    assert make_lookup_row(p99_ms=1.0).target_met
    assert not make_lookup_row(p99_ms=1.01).target_met
    # Wall-clock p99 can miss through preemption while the CPU time per query meets it.
    assert make_lookup_row(p99_ms=1.5).cpu_target_met


@pytest.mark.parametrize(
    ("field", "value"),
    [("sizes_mib", ()), ("sizes_mib", (0,)), ("repeats", 0), ("lookup_counts", (0,)),
     ("num_queries", 0), ("max_grpc_populated_segments", -1)],
)  # fmt: skip
def test_config_rejects_bad_values_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        StoreBenchConfig(**{field: value})  # type: ignore[arg-type]


def test_json_round_trips_and_carries_derived_figures() -> None:
    result = make_result()
    data = json.loads(json.dumps(store_bench_to_json(result)))
    assert store_bench_from_json(data) == result
    assert data["transfers"][0]["mb_per_s"] == pytest.approx(result.transfers[0].mb_per_s)
    assert [row["target_met"] for row in data["lookups"]] == [True, False]
    assert [(row["path"], row["target_met"]) for row in data["paths"]] == [
        ("same-host", True), ("grpc", False)
    ]  # fmt: skip


def test_put_path_json_holds_the_six_contract_figures_and_the_load() -> None:
    data = json.loads(json.dumps(store_bench_to_json(make_result())))
    (row,) = data["put_path"]
    assert set(row) == {
        "size_mib", "gb_per_s", "memcpy_gb_per_s", "sidecar_cpu_s_per_gb",
        "client_cpu_s_per_gb", "durability",
    }  # fmt: skip
    gb = 8 * MIB / 1e9
    assert row["gb_per_s"] == pytest.approx(gb / 0.004)
    assert row["memcpy_gb_per_s"] == pytest.approx(gb / 0.001)
    assert row["sidecar_cpu_s_per_gb"] == pytest.approx(0.02 / (10 * gb))  # CPU over 10 puts
    assert row["client_cpu_s_per_gb"] == pytest.approx(0.01 / (10 * gb))
    assert data["put_path_targets"]["met"] == [
        {"size_mib": 8, "ratio": False, "sidecar_cpu": True}
    ]  # 25% of memcpy; 0.24 s/GB
    assert data["put_path_loadavg"] == [1.1, 2.1, 3.1]
    (floor,) = data["put_path_floor"]
    assert floor["gb_per_s"] == pytest.approx(gb / 0.002)
    assert floor["cpu_s_per_gb"] == pytest.approx(0.005 / (10 * gb))
    assert "fdatasync" in floor["how"] and "100 ms" in floor["how"]


def test_render_shows_each_row_and_its_verdict() -> None:
    text = render_text(make_result())
    assert "839" in text  # MB/s of the 8 MiB get
    assert "p99 <= 1 ms met" in text and "p99 <= 1 ms missed" in text
    assert "sync on" in text
    assert ">= 60% of copyto met" in text and ">= 1000 MB/s missed" in text


def test_segment_meta_keys_are_chained_and_checksum_matches() -> None:
    rng = np.random.default_rng(0)
    payload = make_payload(rng, 4096)
    meta = make_segment_meta(rng, payload)
    assert meta.context_key == context_key(root_key(meta.model_fingerprint), meta.token_ids)
    assert meta.content_key == content_key(meta.token_ids)
    assert meta.checksum == xxhash.xxh3_64_intdigest(payload)
    assert meta.payload_nbytes == len(payload)


def test_lmdb_transfer_store_has_no_memory_tier_and_syncs(tmp_path: Path) -> None:
    config = StoreBenchConfig(sizes_mib=(1, 8), repeats=2)
    lmdb_store = transfer_server_config(config, "lmdb", tmp_path).store
    assert lmdb_store.memory is None and lmdb_store.lmdb is not None and lmdb_store.lmdb.sync
    memory_store = transfer_server_config(config, "memory", tmp_path).store
    assert memory_store.lmdb is None and memory_store.memory is not None
    assert memory_store.memory.max_bytes >= (1 + 8) * MIB * (config.repeats + 1)


@pytest.mark.slow
def test_tiny_run_end_to_end_has_complete_positive_rows(tmp_path: Path) -> None:
    # 200 segments are preloaded into LMDB, 60 are put through gRPC: both paths run.
    config = StoreBenchConfig(
        sizes_mib=(1,), repeats=1, lookup_counts=(200, 60), tmp_dir=str(tmp_path),
        num_queries=20, max_grpc_populated_segments=100, path_sizes_mib=(1,),
        put_path_sizes_mib=(1,),
    )  # fmt: skip
    result = run_store_bench(config)
    assert {(r.tier, r.operation, r.size_mib) for r in result.transfers} == {
        (tier, op, 1) for tier in TIERS for op in ("put", "get")
    }
    for transfer in result.transfers:
        assert min(transfer.seconds, transfer.copyto_seconds, transfer.mb_per_s) > 0
    assert [(r.path, r.size_mib) for r in result.paths] == [(p, 1) for p in READ_PATHS]
    assert [r.size_mib for r in result.put_path] == [1]
    assert all(min(r.seconds, r.memcpy_seconds, r.sidecar_cpu_s) > 0 for r in result.put_path)
    assert [r.size_mib for r in result.put_path_floor] == [1]
    assert all(min(r.seconds, r.cpu_s) > 0 for r in result.put_path_floor)
    assert all(min(r.seconds, r.copyto_seconds) > 0 for r in result.paths)
    assert {(r.path, r.kind, r.num_segments) for r in result.lookups} == {
        (path, kind, count)
        for path in ("in-process", "grpc")
        for kind in LOOKUP_KINDS
        for count in (200, 60)
    }
    for lookup in result.lookups:
        assert 0 < lookup.p50_ms <= lookup.p99_ms and lookup.populate_s > 0
        assert lookup.num_queries == 20
    assert all(r.hit_rate == 1.0 for r in result.lookups if r.kind == "exact")
    assert {r.populated_via for r in result.lookups if r.path == "grpc"} == {
        "gRPC put", "LMDB preload + rebuild"
    }  # fmt: skip
    assert store_bench_from_json(json.loads(json.dumps(store_bench_to_json(result)))) == result
    assert not list(tmp_path.iterdir())  # the LMDB environments are removed
