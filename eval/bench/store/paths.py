"""`bench store` read paths: `StoreClient.get_segment` on the sidecar's host, in place
(same-host) and forced over gRPC (what another host gets), beside a memory copy.

The sidecar runs in a child process with an LMDB tier alone, as a worker's neighbour
would; both rows read the same segments, each read verified (xxh3) and handed back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvsplice.common.errors import StoreUnavailable
from kvsplice.common.segment import SegmentMeta
from kvsplice.eval.bench.store.payloads import (
    MIB,
    CopyTimed,
    copyto_of,
    make_payload,
    make_segment_meta,
)
from kvsplice.eval.measure.stopwatch import median_seconds
from kvsplice.index.bench_lookup import BENCH_NAMESPACE
from kvsplice.server.sidecar_process import SidecarProcess, SidecarSpec
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

logger = logging.getLogger(__name__)

READ_PATHS = ("same-host", "grpc")
SAME_HOST_TARGET_RATIO = 0.6  # of a memory copy of the same bytes
GRPC_TARGET_MB_S = 1000.0


@dataclass(frozen=True)
class PathRow(CopyTimed):
    """Median seconds of one `get_segment` by `path`, and of `numpy.copyto` of its bytes."""

    path: str  # "same-host" | "grpc"
    size_mib: int
    seconds: float
    copyto_seconds: float

    @property
    def target(self) -> str:
        if self.path == "same-host":
            return f">= {SAME_HOST_TARGET_RATIO:.0%} of copyto"
        return f">= {GRPC_TARGET_MB_S:.0f} MB/s"

    @property
    def target_met(self) -> bool:
        if self.path == "same-host":
            return self.ratio_to_copyto >= SAME_HOST_TARGET_RATIO
        return self.mb_per_s >= GRPC_TARGET_MB_S


def bench_read_paths(
    sizes_mib: tuple[int, ...],
    repeats: int,
    tmp_dir: Path,
    client_config: StoreClientConfig,
    seed: int,
    lmdb_sync: bool,
) -> list[PathRow]:
    """Both paths per size, against one sidecar process holding one segment per size."""
    if not sizes_mib:
        return []
    map_size = 2 * sum(sizes_mib) * MIB + 64 * MIB
    spec = SidecarSpec(
        str(tmp_dir / "paths-lmdb"),
        map_size_bytes=map_size,
        lmdb_sync=lmdb_sync,
        max_payload_nbytes=max(sizes_mib) * MIB,
    )
    same_host = replace(client_config, same_host_reads=True)
    over_grpc = replace(client_config, same_host_reads=False)
    rows: list[PathRow] = []
    with (
        SidecarProcess(spec) as sidecar,
        StoreClient(sidecar.target, BENCH_NAMESPACE, config=same_host) as local,
        StoreClient(sidecar.target, BENCH_NAMESPACE, config=over_grpc) as remote,
    ):
        rng = np.random.default_rng((seed, 7))
        for size_mib in sizes_mib:
            payload = make_payload(rng, size_mib * MIB)
            meta = make_segment_meta(rng, payload)
            if not local.put_segment(meta, payload):
                raise StoreUnavailable(f"put of {size_mib} MiB degraded; the run is void")
            copyto_s, _ = median_seconds(copyto_of(payload), repeats)
            for path, client in (("same-host", local), ("grpc", remote)):
                seconds = _read_seconds(client, meta, repeats)
                rows.append(PathRow(path, size_mib, seconds, copyto_s))
        if local.counters.num_same_host_reads == 0:
            raise StoreUnavailable("the same-host path was never taken; the run is void")
    logger.info("bench store read paths: %s", rows)
    return rows


def _read_seconds(client: StoreClient, meta: SegmentMeta, repeats: int) -> float:
    def read() -> int:
        found = client.get_segment(meta.context_key)
        if found is None or len(found[1]) != meta.payload_nbytes:
            raise StoreUnavailable(f"get of {meta.segment_id} missed; the run is void")
        return len(found[1])

    seconds, _ = median_seconds(read, repeats, warmup=2)
    return seconds
