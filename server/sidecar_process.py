"""A store sidecar in a child process of this host: what a worker next to it sees.

For benchmarks and tests of the same-host data plane (LMDB forbids one process to
open an environment twice, so the reader must be another process). Owns the child's
start and stop only; the store is the ordinary `EmbeddedStore` with an LMDB tier.
"""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

from kvsplice.common.staging import AUTO_STAGING_DIR
from kvsplice.storage.config import LMDBTierConfig

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class SidecarSpec:
    """Plain values (they cross a spawn): an LMDB tier alone, optionally under a memory tier."""

    lmdb_path: str
    map_size_bytes: int
    lmdb_sync: bool = False
    memory_bytes: int | None = None
    chunk_nbytes: int = 4 << 20
    max_payload_nbytes: int | None = None  # None: the service's default
    sweep_interval_s: float = 60.0  # how often expired segments are removed
    admin: bool = False  # serve the admin API on a free loopback port (`admin_url`)
    staging_dir: str | None = AUTO_STAGING_DIR  # staged puts (`common.staging`); None: off
    lmdb: LMDBTierConfig | None = None  # the whole tier config; None: from the fields above

    def __post_init__(self) -> None:
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes {self.memory_bytes} must be > 0 or None")


class SidecarProcess:
    """`start()` → a sidecar serving at `target` in a spawned child; `stop()` ends it."""

    def __init__(self, spec: SidecarSpec) -> None:
        self.spec = spec
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(spec, child_conn), name="kvsplice-sidecar", daemon=True
        )
        self.target = ""
        self.admin_url: str | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start(self) -> str:
        self._process.start()
        if not self._conn.poll(START_TIMEOUT_S):
            self._process.kill()
            raise TimeoutError(f"sidecar did not start within {START_TIMEOUT_S} s")
        message = self._conn.recv()
        if isinstance(message, BaseException):
            self._process.join(STOP_TIMEOUT_S)
            raise message
        self.target, self.admin_url = message
        return self.target

    def cpu_seconds(self) -> float:
        """The child's process CPU time so far (user + system, every thread of it)."""
        self._conn.send("cpu")
        return float(self._conn.recv())

    def stop(self) -> None:
        if self._process.is_alive():
            self._conn.send("stop")
            self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()

    def __enter__(self) -> SidecarProcess:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _serve(spec: SidecarSpec, conn: Connection) -> None:
    from kvsplice.server.config import SegmentServiceConfig, ServerConfig
    from kvsplice.server.embedded import EmbeddedStore
    from kvsplice.storage.config import MemoryTierConfig, StoreConfig

    lmdb = spec.lmdb or LMDBTierConfig(
        spec.lmdb_path, map_size_bytes=spec.map_size_bytes, sync=spec.lmdb_sync
    )
    memory = None if spec.memory_bytes is None else MemoryTierConfig(max_bytes=spec.memory_bytes)
    service = SegmentServiceConfig()
    if spec.max_payload_nbytes is not None:
        service = replace(service, max_payload_nbytes=spec.max_payload_nbytes)
    config = ServerConfig(
        listen_address="127.0.0.1:0",
        store=StoreConfig(memory=memory, lmdb=lmdb),
        service=service,
        grace_period_s=1.0,
        chunk_nbytes=spec.chunk_nbytes,
        sweep_interval_s=spec.sweep_interval_s,
        staging_dir=spec.staging_dir,
        admin_port=0 if spec.admin else None,
    )
    try:
        store = EmbeddedStore(config)
        store.start()
    except BaseException as exc:
        conn.send(exc)
        raise
    try:
        conn.send((store.target, store.admin_url))
        while conn.recv() == "cpu":  # until "stop", or EOFError when the parent went away
            conn.send(time.process_time())
    except EOFError:
        pass
    finally:
        store.stop()
