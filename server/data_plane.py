"""What the sidecar tells clients about reading its segments in place on its own host.

Owns the description only (host, LMDB directory and data file, pid, the staging folder
for staged puts: `common.staging`, and where "auto" puts it); the reading is
`storage.lmdb_reader`'s and the choice of path the client's. Without an LMDB tier, or
with a shared tier behind it, there is nothing final to read in place: clients stay on gRPC.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from kvsplice.common.host import host_id
from kvsplice.common.staging import AUTO_STAGING_DIR, LMDB_STAGING_DIR, default_staging_dir
from kvsplice.proto import store_pb2 as pb
from kvsplice.storage.config import StoreConfig
from kvsplice.storage.lmdb_reader import data_file_id
from kvsplice.storage.payload_files import payload_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataPlane:
    host_id: str
    lmdb_path: str  # "" when the store has no LMDB tier
    lmdb_file_id: tuple[int, int]
    server_pid: int
    staging_dir: str = ""  # "" when staged puts are off

    def to_response(self, *, in_place_reads: bool) -> pb.DescribeDataPlaneResponse:
        """What a caller is told: staged puts for every writer on this host; where the
        LMDB file is only with `in_place_reads` (it holds every tenant's bytes)."""
        if not in_place_reads:
            return pb.DescribeDataPlaneResponse(
                host_id=self.host_id, server_pid=self.server_pid, staging_dir=self.staging_dir
            )
        device, inode = self.lmdb_file_id
        return pb.DescribeDataPlaneResponse(
            host_id=self.host_id,
            lmdb_path=self.lmdb_path,
            lmdb_device=device,
            lmdb_inode=inode,
            server_pid=self.server_pid,
            staging_dir=self.staging_dir,
        )


def describe_data_plane(store: StoreConfig, staging_dir: str | None = None) -> DataPlane:
    """The data plane of a store built from `store` (call after its tiers are open), with
    staged puts in `staging_dir` ("auto": `resolve_staging_dir`) where this process can
    use it."""
    staging = _usable_staging_dir(resolve_staging_dir(store, staging_dir))
    if staging and store.lmdb is not None and store.lmdb.adopts_payload_files:
        _check_same_filesystem(staging, payload_dir(os.path.abspath(store.lmdb.path)))
    # NOTE: with a shared tier the LMDB holds only what this sidecar wrote or read: a
    # miss there is no miss of the store, so clients read over gRPC (which falls through).
    if store.lmdb is None or store.redis is not None:
        return DataPlane(host_id(), "", (0, 0), os.getpid(), staging)
    path = os.path.abspath(store.lmdb.path)
    return DataPlane(host_id(), path, data_file_id(path), os.getpid(), staging)


def resolve_staging_dir(store: StoreConfig, staging_dir: str | None) -> str | None:
    """`staging_dir`, with AUTO_STAGING_DIR resolved: a folder inside the LMDB tier's
    directory where that tier adopts payload files (the same filesystem as its payload
    folder: a staged payload is renamed in, never copied), else /dev/shm (memory)."""
    if staging_dir != AUTO_STAGING_DIR:
        return staging_dir
    if store.lmdb is None or not store.lmdb.adopts_payload_files:
        return default_staging_dir()
    path = os.path.join(os.path.abspath(store.lmdb.path), LMDB_STAGING_DIR)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def _check_same_filesystem(staging_dir: str, payload_folder: str) -> None:
    if os.stat(staging_dir).st_dev != os.stat(payload_folder).st_dev:
        logger.warning(
            "staging folder %s is not on the filesystem of the payload folder %s: staged "
            "payloads are copied into LMDB, not adopted as files",
            staging_dir, payload_folder,
        )  # fmt: skip


def _usable_staging_dir(staging_dir: str | None) -> str:
    if not staging_dir:
        return ""
    path = os.path.abspath(staging_dir)
    if not (os.path.isdir(path) and os.access(path, os.R_OK | os.X_OK)):
        logger.warning("staging folder %s is not readable here: puts are streamed", path)
        return ""
    return path
