"""`bench store` put path floor: the same bytes written by plain Python into a file beside
the put path's LMDB, fsynced on the LMDB tier's default window, with no store around it.

Owns the measurement only. What the host's page cache and write-back cost per GB before
any store work (no hash, no gRPC, no record): `put_path`'s sidecar CPU cannot go below it
on this host. As there, the timed writes reuse a region already written and fsynced once
(a store that evicts while it fills), an fsync runs at most `sync_interval_ms` after the
first unsynced write, and the CPU (this process: every thread, user and system) is read
once the last write is fsynced.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsplice.eval.bench.store.payloads import MIB, make_payload
from kvsplice.storage.config import LMDBTierConfig

GB = 1_000_000_000
FLOOR_HOW = "os.pwrite into a reused file region, os.fdatasync on the LMDB tier's window"


@dataclass(frozen=True)
class PutFloorRow:
    """Timed writes of one size: median wall seconds per write, CPU seconds summed."""

    size_mib: int
    num_writes: int
    seconds: float  # median wall time of one os.pwrite (its fsync comes later, as a put's)
    cpu_s: float  # this process over all writes and their fsyncs
    sync_interval_ms: float

    @property
    def gb_per_s(self) -> float:
        return self.size_mib * MIB / GB / self.seconds

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.num_writes * self.size_mib * MIB / GB)

    def summary_json(self) -> dict[str, float | int | str]:
        return {
            "size_mib": self.size_mib,
            "gb_per_s": self.gb_per_s,
            "cpu_s_per_gb": self.cpu_s_per_gb,
            "how": f"{FLOOR_HOW} ({self.sync_interval_ms:g} ms)",
        }


def bench_put_floor(
    sizes_mib: tuple[int, ...], repeats: int, tmp_dir: Path, seed: int
) -> list[PutFloorRow]:
    """One file per size, `repeats` timed writes each."""
    interval_s = LMDBTierConfig(str(tmp_dir)).sync_interval_ms / 1e3
    return [_bench_size(size, repeats, tmp_dir, seed, interval_s) for size in sizes_mib]


def _bench_size(
    size_mib: int, repeats: int, tmp_dir: Path, seed: int, interval_s: float
) -> PutFloorRow:
    nbytes = size_mib * MIB
    payload = make_payload(np.random.default_rng((seed, 52, size_mib)), nbytes)
    path = tmp_dir / f"put-floor-{size_mib}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for index in range(repeats):  # first touch, then clean: the region is reused
            os.pwrite(fd, payload, index * nbytes)
        os.fdatasync(fd)
        window = _Window(fd, interval_s)
        samples = []
        start_cpu_s = time.process_time()
        for index in range(repeats):
            start_s = time.perf_counter()
            os.pwrite(fd, payload, index * nbytes)
            samples.append(time.perf_counter() - start_s)
            window.written()
        window.close()
        cpu_s = time.process_time() - start_cpu_s
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return PutFloorRow(size_mib, repeats, statistics.median(samples), cpu_s, interval_s * 1e3)


class _Window:
    """fsyncs `fd` at most `interval_s` after its first unsynced write; `close` syncs the rest."""

    def __init__(self, fd: int, interval_s: float) -> None:
        self._fd = fd
        self._interval_s = interval_s
        self._dirty = threading.Event()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="put-floor-sync", daemon=True)
        self._thread.start()

    def written(self) -> None:
        self._dirty.set()

    def close(self) -> None:
        self._closing.set()
        self._dirty.set()
        self._thread.join()
        os.fdatasync(self._fd)

    def _run(self) -> None:
        while True:
            self._dirty.wait()
            if self._closing.wait(self._interval_s):
                return
            self._dirty.clear()
            os.fdatasync(self._fd)
