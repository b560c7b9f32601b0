"""What `bench store` shows: rich tables of a `StoreBenchResult` and its JSON form (both ways).

Owns presentation only; the figures and their targets come from `bench`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from kvsplice.eval.bench.store.bench import (
    GET_STRETCH_MB_S,
    GET_TARGET_MB_S,
    GET_TARGET_SIZE_MIB,
    LookupRow,
    StoreBenchResult,
    TransferRow,
    os_load,
)
from kvsplice.eval.bench.store.config import StoreBenchConfig
from kvsplice.eval.bench.store.paths import PathRow
from kvsplice.eval.bench.store.put_floor import PutFloorRow
from kvsplice.eval.bench.store.put_path import (
    TARGET_RATIO_TO_MEMCPY,
    TARGET_SIDECAR_CPU_S_PER_GB,
    PutPathRow,
)
from kvsplice.eval.report.tables import figures_table

logger = logging.getLogger(__name__)

_TRANSFER_DERIVED = ("mb_per_s", "copyto_mb_per_s", "ratio_to_copyto", "target_met")
_LOOKUP_DERIVED = ("target_met", "cpu_target_met")
_PATH_DERIVED = ("mb_per_s", "ratio_to_copyto", "target", "target_met")
_PUT_PATH_TARGETS = {
    "gb_per_s_vs_memcpy": f">= {TARGET_RATIO_TO_MEMCPY:.0%} of memcpy_gb_per_s",
    "sidecar_cpu_s_per_gb": f"<= {TARGET_SIDECAR_CPU_S_PER_GB:g}",
}


def render_store_bench(result: StoreBenchResult) -> list[RenderableType]:
    """The transfer table, the lookup table and a line on the host (the CLI prints them)."""
    tables: list[RenderableType] = [
        render_transfers(result),
        render_lookups(result.lookups),
        _host_line(result),
    ]
    if result.paths:
        tables.insert(0, render_paths(result.paths))
    if result.put_path_floor:
        tables.insert(0, render_put_floor(result.put_path_floor))
    if result.put_path:
        tables.insert(0, render_put_path(result.put_path))
    return tables


def render_put_path(rows: Sequence[PutPathRow]) -> Table:
    table = figures_table(
        ("MiB", "ms", "GB/s", "memcpy GB/s", "vs memcpy", "sidecar cpu s/GB",
         "client cpu s/GB", "durability"), ("MiB",),
        title="kvsplice bench store: staged put until committed in LMDB (sidecar in another process)",
        caption=(
            "A client on the sidecar's host puts through its staging file; ms = median per put "
            "until acknowledged. cpu = process CPU time (user + system, all threads) per GB put. "
            f"Targets: >= {TARGET_RATIO_TO_MEMCPY:.0%} of memcpy, sidecar "
            f"<= {TARGET_SIDECAR_CPU_S_PER_GB:g} s/GB. GB = 10^9 bytes."
        ),
    )  # fmt: skip
    for row in rows:
        table.add_row(
            str(row.size_mib), f"{row.seconds * 1e3:.2f}", f"{row.gb_per_s:.2f}",
            f"{row.memcpy_gb_per_s:.2f}",
            _verdict(row.ratio_met, f"{row.gb_per_s / row.memcpy_gb_per_s:.0%}"),
            _verdict(row.sidecar_cpu_met, f"{row.sidecar_cpu_s_per_gb:.3f}"),
            f"{row.client_cpu_s_per_gb:.3f}", row.durability,
        )  # fmt: skip
    return table


def render_put_floor(rows: Sequence[PutFloorRow]) -> Table:
    table = figures_table(
        ("MiB", "ms", "GB/s", "cpu s/GB"), ("MiB",),
        title="kvsplice bench store: the put path's floor, the same bytes by plain Python",
        caption=(
            "os.pwrite into a file region written once before, os.fdatasync on the LMDB "
            "tier's default window; ms = median per write; cpu = this process (all threads) "
            "per GB, its fsyncs included. No store work: the sidecar cannot go below it."
        ),
    )  # fmt: skip
    for row in rows:
        table.add_row(
            str(row.size_mib), f"{row.seconds * 1e3:.2f}", f"{row.gb_per_s:.2f}",
            f"{row.cpu_s_per_gb:.3f}",
        )  # fmt: skip
    return table


def render_paths(rows: Sequence[PathRow]) -> Table:
    table = figures_table(
        ("path", "MiB", "ms", "MB/s", "vs copyto", "target"), ("path",),
        title="kvsplice bench store: StoreClient.get_segment by read path (sidecar in another process)",
        caption=(
            "same-host = read in place from the sidecar's LMDB (checksummed, no copy); "
            "grpc = the same read forced over loopback gRPC, as from another host. "
            "copyto = numpy.copyto of the same bytes in the same run. MB = 10^6 bytes."
        ),
    )  # fmt: skip
    for row in rows:
        table.add_row(
            row.path, str(row.size_mib), f"{row.seconds * 1e3:.2f}", f"{row.mb_per_s:.0f}",
            f"{row.ratio_to_copyto:.0%}", _verdict(row.target_met, row.target),
        )  # fmt: skip
    return table


def render_transfers(result: StoreBenchResult) -> Table:
    sync = (
        "sync on: fsync per commit, the durable default" if result.config.lmdb_sync else "sync off"
    )
    table = figures_table(
        ("tier", "op", "MiB", "ms", "MB/s", "copyto MB/s", "vs copyto", "target"), ("tier", "op"),
        title=f"kvsplice bench store: put/get over loopback gRPC (median of {result.config.repeats})",
        caption=(
            f"memory = memory tier alone; lmdb = LMDB tier alone ({sync}), every get reads LMDB. "
            f"Target: get >= {GET_TARGET_MB_S:.0f} MB/s at {GET_TARGET_SIZE_MIB} MiB "
            f"(stretch {GET_STRETCH_MB_S:.0f}). MB = 10^6 bytes."
        ),
    )  # fmt: skip
    for row in result.transfers:
        table.add_row(
            row.tier, row.operation, str(row.size_mib), f"{row.seconds * 1e3:.1f}",
            f"{row.mb_per_s:.0f}", f"{row.copyto_mb_per_s:.0f}", f"{row.ratio_to_copyto:.1%}",
            _verdict(row.target_met, f">= {row.target_mb_s:.0f}" if row.target_mb_s else ""),
        )  # fmt: skip
    return table


def render_lookups(rows: Sequence[LookupRow]) -> Table:
    columns = ("path", "kind", "segments", "populated via", "populate s", "p50 ms",
               "p99 ms", "cpu p99 ms", "hits", "target", "on cpu")  # fmt: skip
    table = figures_table(
        columns, ("path", "kind"),
        title="kvsplice bench store: lookup latency per query",
        caption=(
            "in-process = the index alone; grpc = StoreClient end to end. cpu = CPU time per "
            "query (grpc: client + server threads), free of preemption. Targets stated at 100k."
        ),
    )  # fmt: skip
    for row in rows:
        table.add_row(
            row.path, row.kind, f"{row.num_segments:,}", row.populated_via,
            f"{row.populate_s:.1f}", f"{row.p50_ms:.3f}", f"{row.p99_ms:.3f}",
            f"{row.cpu_p99_ms:.3f}", f"{row.hit_rate:.0%}",
            _verdict(row.target_met, f"p99 <= {row.target_p99_ms:g} ms"),
            _verdict(row.cpu_target_met, "cpu"),
        )  # fmt: skip
    return table


def _verdict(met: bool | None, target: str) -> Text:
    if met is None:
        return Text("-")
    return Text(f"{target} met", style="green") if met else Text(f"{target} missed", style="red")


def _host_line(result: StoreBenchResult) -> Text:
    before = ", ".join(f"{v:.2f}" for v in result.load_before)
    after = ", ".join(f"{v:.2f}" for v in result.load_after)
    return Text(
        f"{result.num_cpus} CPUs; load average (1/5/15 min) {before} before, {after} after; "
        f"{result.seconds:.0f} s in all."
    )


# -- JSON -------------------------------------------------------------------------------


def store_bench_to_json(result: StoreBenchResult) -> dict[str, Any]:
    """Plain JSON types; rows carry their derived figures too (ignored when read back)."""
    return {
        "config": _fields_of(result.config),
        "transfers": [_row_json(row, _TRANSFER_DERIVED) for row in result.transfers],
        "lookups": [_row_json(row, _LOOKUP_DERIVED) for row in result.lookups],
        "paths": [_row_json(row, _PATH_DERIVED) for row in result.paths],
        "put_path": [row.contract_json() for row in result.put_path],
        "put_path_rows": [_fields_of(row) for row in result.put_path],
        "put_path_targets": _PUT_PATH_TARGETS
        | {
            "met": [
                {"size_mib": r.size_mib, "ratio": r.ratio_met, "sidecar_cpu": r.sidecar_cpu_met}
                for r in result.put_path
            ]
        },
        "put_path_loadavg": list(result.put_path_load),
        "put_path_floor": [row.summary_json() for row in result.put_path_floor],
        "put_path_floor_rows": [_fields_of(row) for row in result.put_path_floor],
        "load_before": list(result.load_before),
        "load_after": list(result.load_after),
        "num_cpus": result.num_cpus,
        "seconds": result.seconds,
    }


def store_bench_from_json(data: dict[str, Any]) -> StoreBenchResult:
    """The inverse of `store_bench_to_json`."""
    return StoreBenchResult(
        config=_from_fields(StoreBenchConfig, data["config"]),
        transfers=tuple(_from_fields(TransferRow, row) for row in data["transfers"]),
        lookups=tuple(_from_fields(LookupRow, row) for row in data["lookups"]),
        load_before=os_load(data["load_before"]),
        load_after=os_load(data["load_after"]),
        num_cpus=int(data["num_cpus"]),
        seconds=float(data["seconds"]),
        paths=tuple(_from_fields(PathRow, row) for row in data.get("paths", ())),
        put_path=tuple(_from_fields(PutPathRow, row) for row in data.get("put_path_rows", ())),
        put_path_load=os_load(data.get("put_path_loadavg", (0.0, 0.0, 0.0))),
        put_path_floor=tuple(
            _from_fields(PutFloorRow, row) for row in data.get("put_path_floor_rows", ())
        ),
    )


def _fields_of(record: Any) -> dict[str, Any]:
    values = {f.name: getattr(record, f.name) for f in fields(record)}
    return {name: list(v) if isinstance(v, tuple) else v for name, v in values.items()}


def _row_json(row: Any, derived: Sequence[str]) -> dict[str, Any]:
    return _fields_of(row) | {name: getattr(row, name) for name in derived}


def _from_fields(cls: Any, data: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in names}
    return cls(**values)
