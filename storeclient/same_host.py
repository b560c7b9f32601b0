"""The same-host read path: segments read in place from the sidecar's LMDB environment.

Owns the choice (same host, same files, another process) and the checks a read must
pass before its bytes are returned: namespace, expiry and fingerprint here; record,
meta and payload checksums in `storage.lmdb_reader`. Transport and retries belong to
the store clients, which fall back to gRPC whenever this path cannot serve a read.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from kvsplice.common.errors import CorruptPayload, FingerprintMismatch, StoreUnavailable
from kvsplice.common.host import host_id
from kvsplice.common.segment import SegmentMeta
from kvsplice.storage.lmdb_reader import LMDBReader
from kvsplice.storeclient.results import DataPlaneInfo

logger = logging.getLogger(__name__)


class SameHostPath:
    """Reads of one namespace served from the sidecar's environment, opened read-only."""

    def __init__(
        self, reader: LMDBReader, namespace: str, clock: Callable[[], float] = time.time
    ) -> None:
        self._reader = reader
        self._namespace = namespace
        self._clock = clock
        self._pid = os.getpid()

    @classmethod
    def open(cls, plane: DataPlaneInfo, namespace: str) -> SameHostPath | None:
        """The path if `plane` is readable from this process; None means gRPC only."""
        if not plane.lmdb_path or plane.host_id != host_id():
            return None
        if plane.server_pid == os.getpid():  # LMDB forbids opening one environment twice
            return None
        try:
            reader = LMDBReader.acquire(plane.lmdb_path, plane.lmdb_file_id)
        except StoreUnavailable as error:
            logger.info("same-host reads off (%s); reading over gRPC", error)
            return None
        logger.info("same-host reads from %s", plane.lmdb_path)
        return cls(reader, namespace)

    @property
    def usable(self) -> bool:
        """False in a child forked after the open (LMDB handles must not cross a fork)."""
        return os.getpid() == self._pid

    def get_segment(
        self, context_key: bytes, model_fingerprint: str | None
    ) -> tuple[SegmentMeta, memoryview] | None:
        """The live segment and its verified payload (a view into the map), or None.

        Raises `StoreUnavailable` when the environment cannot be read (the caller goes
        over gRPC), `CorruptPayload` on a record failing verification and
        `FingerprintMismatch` like the server does.
        """
        found = self._reader.read(self._namespace, context_key)
        if found is None:
            return None
        meta = found.meta
        if meta.namespace != self._namespace or meta.context_key != context_key:
            raise CorruptPayload(f"record under {context_key.hex()} holds another segment")
        if meta.ttl_s is not None and meta.created_at_s + meta.ttl_s < self._clock():
            return None  # expired: the sidecar removes it on its next sweep or read
        if model_fingerprint and meta.model_fingerprint != model_fingerprint:
            raise FingerprintMismatch(
                f"segment {meta.segment_id} belongs to {meta.model_fingerprint}, "
                f"not {model_fingerprint}"
            )
        return meta, found.payload

    def close(self) -> None:
        if self.usable:
            self._reader.release()
