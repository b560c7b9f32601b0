"""`bench store` put path: a staged put from a client on the sidecar's host until the
sidecar has committed it in LMDB, at the LMDB tier's default durability, beside a memory
copy of the same bytes, with the CPU time each process spent on it.

Owns the measurement only. The sidecar is a child process holding an LMDB tier alone (the
durable tier a same-host reader reads in place); its CPU time is the child's process CPU
time (`time.process_time` there: every thread, user and system), the client's this
process's, both summed over the timed puts. Before timing, as many segments as are timed
are put, then deleted, so the timed puts reuse the map's pages, as a store that evicts while
it fills does (a store still growing its file also pays the kernel for fresh pages), and
the fsync window is left to write the warm-up back. Ahead of them `RESIDENT_MIB` of
segments stay, as in a store past its first few dozen MiB: the kernel gives the first
~40 MiB a process writes through the map 4 KiB page-cache folios (its readahead ramp),
later pages large ones, and a put into 4 KiB folios takes a write fault per page after
each fsync (~4x the CPU of LMDB's copy; docs/results.md, "Store put path"). The
sidecar's CPU is read once the window has fsynced the timed puts too: what durability at
the default costs is in it.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsplice.common.errors import StoreUnavailable
from kvsplice.common.segment import SegmentMeta
from kvsplice.eval.bench.store.payloads import MIB, copyto_of, make_payload, make_segment_meta
from kvsplice.eval.measure.stopwatch import median_seconds
from kvsplice.index.bench_lookup import BENCH_NAMESPACE
from kvsplice.server.sidecar_process import SidecarProcess, SidecarSpec
from kvsplice.storage.config import LMDBTierConfig, describe_durability
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

logger = logging.getLogger(__name__)

GB = 1_000_000_000
TARGET_RATIO_TO_MEMCPY = 0.5
TARGET_SIDECAR_CPU_S_PER_GB = 0.25
RESIDENT_MIB = 64  # segments that stay ahead of the timed ones (see above)


@dataclass(frozen=True)
class PutPathRow:
    """Timed staged puts of one size: median wall seconds per put, CPU seconds summed."""

    size_mib: int
    num_puts: int
    seconds: float  # median wall time of one put, client call to acknowledged commit
    memcpy_seconds: float  # median numpy.copyto of the same bytes
    sidecar_cpu_s: float  # the sidecar process, over all `num_puts`
    client_cpu_s: float  # this process, over all `num_puts`
    durability: str

    @property
    def gb_per_s(self) -> float:
        return self.size_mib * MIB / GB / self.seconds

    @property
    def memcpy_gb_per_s(self) -> float:
        return self.size_mib * MIB / GB / self.memcpy_seconds

    @property
    def sidecar_cpu_s_per_gb(self) -> float:
        return self.sidecar_cpu_s / (self.num_puts * self.size_mib * MIB / GB)

    @property
    def client_cpu_s_per_gb(self) -> float:
        return self.client_cpu_s / (self.num_puts * self.size_mib * MIB / GB)

    @property
    def ratio_met(self) -> bool:
        return self.gb_per_s >= TARGET_RATIO_TO_MEMCPY * self.memcpy_gb_per_s

    @property
    def sidecar_cpu_met(self) -> bool:
        return self.sidecar_cpu_s_per_gb <= TARGET_SIDECAR_CPU_S_PER_GB

    def contract_json(self) -> dict[str, float | int | str]:
        """The six figures `bench store --json` promises per size (their names are fixed)."""
        return {
            "size_mib": self.size_mib,
            "gb_per_s": self.gb_per_s,
            "memcpy_gb_per_s": self.memcpy_gb_per_s,
            "sidecar_cpu_s_per_gb": self.sidecar_cpu_s_per_gb,
            "client_cpu_s_per_gb": self.client_cpu_s_per_gb,
            "durability": self.durability,
        }


def bench_put_path(
    sizes_mib: tuple[int, ...],
    repeats: int,
    tmp_dir: Path,
    client_config: StoreClientConfig,
    seed: int,
) -> list[PutPathRow]:
    """One sidecar per size (a fresh map), `repeats` timed staged puts each."""
    return [_bench_size(size, repeats, tmp_dir, client_config, seed) for size in sizes_mib]


def _bench_size(
    size_mib: int, repeats: int, tmp_dir: Path, client_config: StoreClientConfig, seed: int
) -> PutPathRow:
    num_resident = -(-RESIDENT_MIB // size_mib)
    lmdb = LMDBTierConfig(  # every durability field at the tier's default
        str(tmp_dir / f"put-path-{size_mib}"),
        map_size_bytes=(2 * repeats + 4 + num_resident) * size_mib * MIB,
    )
    spec = SidecarSpec(lmdb.path, lmdb.map_size_bytes, max_payload_nbytes=size_mib * MIB, lmdb=lmdb)
    rng = np.random.default_rng((seed, 51, size_mib))
    payload = make_payload(rng, size_mib * MIB)
    with (
        SidecarProcess(spec) as sidecar,
        StoreClient(sidecar.target, BENCH_NAMESPACE, config=client_config) as client,
    ):
        for _ in range(num_resident):
            _put(client, make_segment_meta(rng, payload), payload)
        warm = [make_segment_meta(rng, payload) for _ in range(repeats)]
        for meta in warm:  # warm: channel, staging file, and as many map pages as are timed
            _put(client, meta, payload)
        for meta in warm:  # (put all, then delete all: one put and delete at a time reuses 3)
            client.delete(meta.context_key)
        metas = [make_segment_meta(rng, payload) for _ in range(repeats)]
        samples = []
        time.sleep(_settle_s(lmdb))  # the warm-up's write-back is not the timed puts'
        sidecar_start_s, client_start_s = sidecar.cpu_seconds(), time.process_time()
        for meta in metas:
            start_s = time.perf_counter()
            _put(client, meta, payload)
            samples.append(time.perf_counter() - start_s)
        client_cpu_s = time.process_time() - client_start_s
        time.sleep(_settle_s(lmdb))  # the window's fsync of the timed puts is theirs
        sidecar_cpu_s = sidecar.cpu_seconds() - sidecar_start_s
        if client.counters.num_staged_puts < 2 * repeats + num_resident:
            raise StoreUnavailable("puts were streamed, not staged; the run is void")
    memcpy_s, _ = median_seconds(copyto_of(payload), repeats)
    row = PutPathRow(
        size_mib, repeats, statistics.median(samples), memcpy_s, sidecar_cpu_s, client_cpu_s,
        describe_durability(lmdb),
    )  # fmt: skip
    logger.info("bench store put path %d MiB: %s (load %s)", size_mib, row, os.getloadavg())
    return row


def _settle_s(lmdb: LMDBTierConfig) -> float:
    """Long enough for the fsync window to have synced every commit before it."""
    return 2 * lmdb.sync_interval_ms / 1e3 + 0.1


def _put(client: StoreClient, meta: SegmentMeta, payload: bytes) -> None:
    if not client.put_segment(meta, payload):
        raise StoreUnavailable(f"put of segment {meta.segment_id} degraded; the run is void")
