"""Read-only access to a running sidecar's LMDB environment from another process.

Owns the reader side of the durable tier's files: opening the environment read-only
(LMDB serves many reader processes; a read transaction's snapshot never changes under
it), finding a segment's record and verifying it, and keeping the transaction open for
exactly as long as the caller holds the bytes. Expiry and fingerprints are the caller's.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import lmdb
import numpy as np
import xxhash

from kvsplice.common.errors import CorruptPayload, StoreUnavailable
from kvsplice.common.segment import SegmentMeta
from kvsplice.storage.keyspace import segment_key
from kvsplice.storage.lmdb_tier import DB_NAME, MAX_READERS
from kvsplice.storage.payload_files import PayloadRef, map_payload
from kvsplice.storage.record import HEADER_NBYTES, open_record, outside_parts, read_header
from kvsplice.storage.segment_codec import read_meta, segment_payload

logger = logging.getLogger(__name__)

DATA_FILE = "data.mdb"


def data_file_id(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(st_dev, st_ino) of an environment's data file: names the file across processes."""
    stat = os.stat(Path(path) / DATA_FILE)
    return stat.st_dev, stat.st_ino


@dataclass(frozen=True)
class MappedSegment:
    """A verified segment; `payload` is a read-only view into the map (no copy).

    The view keeps its read transaction open until the last reference to it (or to
    anything built on it: numpy arrays, tensors from `torch.frombuffer`) is gone.
    """

    meta: SegmentMeta
    payload: memoryview


class _Pin:
    """Owns one read transaction; numpy arrays over it (`__array_interface__`) keep it alive."""

    def __init__(self, reader: LMDBReader, txn: lmdb.Transaction, view: memoryview) -> None:
        self._reader = reader
        self._txn = txn
        address = np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0
        self.__array_interface__ = {
            "shape": (len(view),),
            "typestr": "|u1",
            "data": (address, True),  # read-only
            "version": 3,
        }

    def __del__(self) -> None:
        self._reader._unpin(self._txn)


class LMDBReader:
    """Segments read in place from the environment at `path` (opened read-only, shared lock).

    Use `acquire` (one reader per environment and process: LMDB forbids opening an
    environment twice in one process) and `release`. The map closes after the last
    release once the last pinned view is gone: a view into an unmapped environment
    would read freed memory.
    """

    _registry: ClassVar[dict[tuple[str, tuple[int, int]], LMDBReader]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def acquire(cls, path: str, expect_file_id: tuple[int, int]) -> LMDBReader:
        """This process's reader of the environment at `path`, whose data file must be
        `expect_file_id` (`StoreUnavailable` if it is another file or cannot be opened)."""
        path = os.path.abspath(path)
        key = (path, expect_file_id)
        with cls._registry_lock:
            reader = cls._registry.get(key)
            if reader is None or reader._pid != os.getpid():
                reader = cls(path, expect_file_id)
                cls._registry[key] = reader
            reader._num_users += 1
            return reader

    def release(self) -> None:
        with LMDBReader._registry_lock:
            self._num_users -= 1
            if self._num_users > 0:
                return
            LMDBReader._registry.pop((self.path, self._file_id), None)
        self.close()

    def __init__(self, path: str, expect_file_id: tuple[int, int]) -> None:
        try:
            file_id = data_file_id(path)
        except OSError as exc:
            raise StoreUnavailable(f"cannot see {path}: {exc}") from exc
        if file_id != expect_file_id:
            raise StoreUnavailable(f"{path} is not the sidecar's environment (another file)")
        try:
            self._env = lmdb.open(
                path,
                readonly=True,
                lock=True,  # readers register in the lock table, so the writer keeps their pages
                create=False,
                subdir=True,
                max_dbs=1,
                max_readers=MAX_READERS,  # the sidecar's lock file decides; this is a floor
                readahead=False,
            )
            self._db = self._env.open_db(DB_NAME, create=False)
        except lmdb.Error as exc:
            raise StoreUnavailable(f"cannot open {path} read-only: {exc}") from exc
        self._env.set_mapsize(0)  # adopt the writer's map size (ours is only a default)
        self._env.reader_check()  # frees slots of reader processes that died
        self._lock = threading.Lock()
        self._num_pinned = 0
        self._closing = False
        self._num_users = 0
        self._pid = os.getpid()
        self._file_id = file_id
        self.path = path

    def read(self, namespace: str, context_key: bytes) -> MappedSegment | None:
        """The verified segment stored under (namespace, context_key), or None if absent
        (a record whose payload file was removed after this read's snapshot is absent).

        Raises `CorruptPayload` on a record that fails verification, `StoreUnavailable`
        when no read transaction can start (closed, reader table full).
        """
        key = segment_key(namespace, context_key)
        self._check_same_file()
        txn = self._begin()
        pinned = False
        try:
            raw = txn.get(key)
            if raw is None:
                return None
            if read_header(raw).tail_outside:
                return _verified_outside(self.path, raw)  # a file's mapping: txn not needed
            segment, pinned = self._verified(txn, raw)
            return segment
        finally:
            if not pinned:
                self._unpin(txn)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            idle = self._num_pinned == 0
        if idle:
            self._env.close()

    def _check_same_file(self) -> None:
        """`StoreUnavailable` once the directory holds another environment (a sidecar that
        started over at the same path): this map would only ever show the old one."""
        try:
            same = data_file_id(self.path) == self._file_id
        except OSError:
            same = False
        if not same:
            raise StoreUnavailable(f"the environment at {self.path} was replaced or removed")

    def _begin(self) -> lmdb.Transaction:
        with self._lock:
            if self._closing:
                raise StoreUnavailable(f"reader of {self.path} is closed")
            try:
                txn = self._begin_locked()
            except lmdb.Error as exc:  # ReadersFullError, MapResizedError with pinned reads
                raise StoreUnavailable(f"no read transaction on {self.path}: {exc}") from exc
            self._num_pinned += 1
        return txn

    def _begin_locked(self) -> lmdb.Transaction:
        try:
            return self._env.begin(db=self._db, buffers=True)
        except lmdb.MapResizedError:
            if self._num_pinned:  # the map may only move while no transaction is open
                raise
            self._env.set_mapsize(0)  # the writer grew the map: adopt its size
            return self._env.begin(db=self._db, buffers=True)

    def _unpin(self, txn: lmdb.Transaction) -> None:
        with self._lock:
            txn.abort()
            self._num_pinned -= 1
            close = self._closing and self._num_pinned == 0
        if close:
            self._env.close()

    def _verified(
        self, txn: lmdb.Transaction, raw: bytes | memoryview
    ) -> tuple[MappedSegment, bool]:
        """The segment in record `raw` (meta digest and payload xxh3 checked, one pass), and
        whether its payload pins `txn` (else the caller ends the transaction)."""
        header = read_header(raw)
        if header.compressed:  # decompressed into fresh memory: the map is not needed
            body = memoryview(open_record(raw))
        elif len(raw) != header.record_nbytes:
            raise CorruptPayload(
                f"record holds {len(raw)} bytes, header says {header.record_nbytes}"
            )
        else:
            body = memoryview(raw)[HEADER_NBYTES:]
        meta = read_meta(body)
        payload = segment_payload(body, meta)
        # NOTE: the envelope's checksum covers meta and payload again; the meta's own
        # digest and the payload's end-to-end xxh3 (the writer's) cover every byte once.
        if xxhash.xxh3_64_intdigest(payload) != meta.checksum:
            raise CorruptPayload(f"payload checksum mismatch for segment {meta.segment_id}")
        if header.compressed:
            return MappedSegment(meta, payload), False
        return MappedSegment(meta, np.asarray(_Pin(self, txn, payload)).data), True


def _verified_outside(lmdb_path: str, raw: bytes | memoryview) -> MappedSegment | None:
    """The segment of a record whose payload is a file, mapped (one xxh3 pass); None if
    the file is gone (removed since the snapshot: the segment was deleted)."""
    _, head, reference = outside_parts(raw)
    meta = read_meta(head)
    payload = map_payload(lmdb_path, PayloadRef.decode(reference))
    if payload is None:
        return None
    if len(payload) != meta.payload_nbytes or xxhash.xxh3_64_intdigest(payload) != meta.checksum:
        raise CorruptPayload(f"payload file of segment {meta.segment_id} fails its checksum")
    return MappedSegment(meta, payload)
