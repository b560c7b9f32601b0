"""The durable tier: sealed records in one LMDB environment on local disk.

Owns transactions (none leaks out: every read is copied out of its transaction
before it ends) and map-full handling; it never evicts on its own: when the map
is full it raises `ResourceExhausted` and the store decides what to evict. Owns the
directory, too: an exclusive lock file keeps a second writer (another sidecar) out.
A staged payload of at least `payload_file_min_nbytes` is adopted as a file beside the
map (`payload_files`): the record holds its head and a reference, the file the payload.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from collections.abc import Iterator

import lmdb

from kvsplice.common.buffers import BufferPool
from kvsplice.common.errors import (
    CorruptPayload,
    InvalidRequest,
    ResourceExhausted,
    StoreUnavailable,
)
from kvsplice.storage.config import LMDBTierConfig, describe_durability
from kvsplice.storage.lmdb_sync import SyncWindow
from kvsplice.storage.payload_files import PayloadFiles, PayloadRef, ref_of_value
from kvsplice.storage.record import (
    SealedRecord,
    as_record,
    body_prefix,
    check_tail,
    open_record,
    outside_parts,
    read_header,
    tail_outside,
    with_tail_outside,
)
from kvsplice.storage.tier import EvictionCallback, TierCounters, TierStats

logger = logging.getLogger(__name__)

DB_NAME = b"records"
LOCK_FILE = "kvsplice.lock"
# Reader slots in the lock table (the sidecar creates it): same-host clients hold one per
# read in flight (`lmdb_reader`), so the default of 126 would be tight.
MAX_READERS = 1024
READ_POOL_BYTES = 256 << 20


# NOTE: the map is larger than the configured capacity by this much. Pages freed while
# a reader's snapshot is open (same-host clients) cannot be reused yet, and a delete
# needs fresh pages to commit: without headroom a full map refuses even the deletes
# that eviction needs. `put` refuses at the configured capacity (live pages).
def map_headroom_bytes(capacity_bytes: int) -> int:
    return capacity_bytes // 4 + (4 << 20)


_KEY_BATCH = 1024


class LMDBTier:
    """`StorageTier` over LMDB; `used_bytes` counts the pages holding live records.

    `on_evict` is accepted for symmetry with the other tiers and never called:
    this tier removes nothing on its own.
    """

    def __init__(
        self,
        config: LMDBTierConfig,
        on_evict: EvictionCallback | None = None,
        name: str = "lmdb",
    ) -> None:
        self.name = name
        self._config = config
        self._counters = TierCounters()
        self._closed = False
        # Bodies are copied out into buffers reused once no reader holds them any more.
        self._buffers = BufferPool(READ_POOL_BYTES)
        os.makedirs(config.path, exist_ok=True)
        self._lock_fd = _lock_directory(config.path)
        try:
            self._env = self._open_env(config)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._db = self._env.open_db(DB_NAME)
        self._files = PayloadFiles(
            config.path,
            keep_for_sync=config.sync,
            spare_room=lambda: config.map_size_bytes - self._used_bytes(),
        )
        self._collect_payload_files()
        self._window = (
            SyncWindow(
                self._sync_all,
                config.sync_interval_ms / 1e3,
                config.max_unsynced_bytes,
                name,
            )
            if config.grouped_sync
            else None
        )
        logger.info("%s at %s: %s", name, config.path, describe_durability(config))

    # NOTE: readahead stays on (no MADV_RANDOM on the map). A put writes a record into the
    # map (writemap), and the page cache gives a page first touched there a large folio only
    # where readahead may run; with MADV_RANDOM every page is its own 4 KiB folio, and each
    # group fsync write-protects them, so the next put into reused pages takes one fault per
    # 4 KiB (measured: 8 MiB put 0.96 -> 0.24-0.35 s of sidecar CPU per GB in LMDB's copy
    # and commit, the fsync 0.49 -> 0.06 s/GB; docs/results.md, "Store put path"). Records are
    # MiBs of contiguous overflow pages, read whole: readahead does not read others' pages.
    @staticmethod
    def _open_env(config: LMDBTierConfig) -> lmdb.Environment:
        map_size = config.map_size_bytes + map_headroom_bytes(config.map_size_bytes)
        per_commit = config.sync and not config.grouped_sync
        return lmdb.open(
            config.path,
            map_size=map_size,
            subdir=True,
            max_dbs=1,
            sync=per_commit,
            metasync=per_commit,
            writemap=config.writemap and _disk_holds_map(config.path, map_size),
            readahead=True,  # NOTE: see above
            lock=True,
            max_readers=MAX_READERS,
        )

    @property
    def sync_window(self) -> SyncWindow | None:
        """The fsync window (None: fsync per commit, or none at all)."""
        return self._window

    def put(self, key: bytes, value: bytes | memoryview | SealedRecord) -> None:
        # NOTE: a `SealedRecord` is stored as it is: txn.put copies it once, straight into
        # the map under writemap, or its staged file is adopted (no copy); it is not hashed
        # here (its receiver verified its payload, or every load verifies it).
        record = as_record(value, self._config.compress)
        self._check_open()
        if self.used_bytes() + len(record) > self._config.map_size_bytes:
            raise ResourceExhausted(
                f"{self.name}: {self._config.map_size_bytes} bytes hold no room for a record "
                f"of {len(record)} bytes"
            )
        ref = self._adopted(value, record)
        stored = record if ref is None else with_tail_outside(record, ref.encode())
        try:
            replaced = self._commit(key, stored, len(record))
        except BaseException:
            if ref is not None and isinstance(value, SealedRecord) and value.staged is not None:
                self._files.give_back(ref, value.staged)  # a retry may adopt it again
            raise
        if replaced is not None:
            self._files.remove(replaced)
        if self._window is not None:
            self._window.committed(len(record))
        self._counters.add(puts=1, bytes_in=len(value))

    def _adopted(
        self, value: bytes | memoryview | SealedRecord, record: bytes | memoryview
    ) -> PayloadRef | None:
        """The payload file `value`'s staged file became, or None: its tail is copied."""
        min_nbytes = self._config.payload_file_min_nbytes
        if (
            not isinstance(value, SealedRecord)
            or value.staged is None
            or record is not value.record
        ):
            return None  # not staged, or re-sealed (compressed)
        header = read_header(record)
        tail_nbytes = header.stored_nbytes - header.head_nbytes
        if not header.split or not min_nbytes or tail_nbytes < min_nbytes:
            return None
        ref = self._files.adopt(value.staged, tail_nbytes)
        if ref is not None and self._config.sync and not self._config.grouped_sync:
            self._files.sync()  # fsync per commit: the file before the record naming it
        return ref

    def _commit(self, key: bytes, stored: bytes | memoryview, nbytes: int) -> PayloadRef | None:
        """Write `stored` under `key`; the payload file of the record it replaced, if any."""
        try:
            with self._env.begin(write=True, db=self._db, buffers=True) as txn:
                replaced = ref_of_value(txn.get(key))
                txn.put(key, stored)
        except lmdb.MapFullError as exc:
            raise ResourceExhausted(
                f"{self.name}: map of {self._config.map_size_bytes} bytes is full "
                f"(record of {nbytes} bytes)"
            ) from exc
        except lmdb.BadValsizeError as exc:
            raise InvalidRequest(f"{self.name}: key of {len(key)} bytes is too long") from exc
        return replaced

    def get(self, key: bytes) -> bytes | memoryview | None:
        self._check_open()
        corrupt: CorruptPayload | None = None
        body: memoryview | None = None
        # NOTE: with buffers=True `raw` aliases the map and dies with the transaction,
        # so the body is verified in place and copied out before the `with` ends.
        outside: bytes | None = None  # a record whose payload is a file: header, head, ref
        with self._env.begin(db=self._db, buffers=True) as txn:
            raw = txn.get(key)
            if raw is not None and tail_outside(raw):
                outside = bytes(raw)
            elif raw is not None:
                try:
                    verified = open_record(raw)
                    body = self._buffers.take(len(verified))
                    body[:] = verified
                except CorruptPayload as exc:
                    corrupt = exc
        if outside is not None:
            try:
                body = self._read_outside(outside)
            except CorruptPayload as exc:
                corrupt = exc
        if corrupt is not None:
            self._discard_corrupt(key, corrupt, outside)
        if body is None:
            self._counters.add(misses=1)
            return None
        self._counters.add(hits=1, bytes_out=len(body))
        return body

    def get_prefix(self, key: bytes, max_nbytes: int) -> bytes | None:
        self._check_open()
        with self._env.begin(db=self._db, buffers=True) as txn:
            raw = txn.get(key)
            if raw is None:
                return None
            try:
                return body_prefix(raw, max_nbytes)
            except CorruptPayload as exc:
                corrupt = exc
        self._discard_corrupt(key, corrupt)
        return None

    def delete(self, key: bytes) -> bool:
        self._check_open()
        try:
            with self._env.begin(write=True, db=self._db, buffers=True) as txn:
                ref = ref_of_value(txn.get(key))
                deleted = bool(txn.delete(key))
        except lmdb.MapFullError as exc:  # headroom used up by pages readers still pin
            raise ResourceExhausted(f"{self.name}: map full, cannot delete {key.hex()}") from exc
        if ref is not None:  # NOTE: after the commit: a crash between leaves an orphan
            self._files.remove(ref)  # (collected at open), never a record without its file
        return deleted

    def contains(self, key: bytes) -> bool:
        self._check_open()
        with self._env.begin(db=self._db, buffers=True) as txn:
            return txn.get(key) is not None

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        # Batches in short read transactions: a long-lived reader would pin old
        # pages and make the map grow while a slow consumer iterates.
        start = prefix
        while True:
            batch = self._key_batch(start, prefix)
            yield from batch
            if len(batch) < _KEY_BATCH:
                return
            start = batch[-1] + b"\x00"  # the smallest key after the last one seen

    def used_bytes(self) -> int:
        self._check_open()
        return self._used_bytes()

    def _used_bytes(self) -> int:
        with self._env.begin() as txn:
            stat = txn.stat(self._db)
        num_pages = stat["branch_pages"] + stat["leaf_pages"] + stat["overflow_pages"]
        return int(num_pages * stat["psize"]) + self._files.nbytes

    def capacity_bytes(self) -> int | None:
        return self._config.map_size_bytes

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._window is not None:
                self._window.close()  # its last fsync
            elif not self._config.sync:
                self._env.sync(True)
        finally:
            self._files.close()
            self._env.close()
            os.close(self._lock_fd)  # closing the descriptor releases the lock

    def stats(self) -> TierStats:
        return self._counters.snapshot()

    def _key_batch(self, start: bytes, prefix: bytes) -> list[bytes]:
        self._check_open()
        batch: list[bytes] = []
        with self._env.begin(db=self._db) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(start):
                return batch
            for key in cursor.iternext(keys=True, values=False):
                if not key.startswith(prefix) or len(batch) == _KEY_BATCH:
                    break
                batch.append(key)
        return batch

    def _sync_all(self) -> None:
        """The sync window's fsync: payload files (and their folder) before the map, so a
        synced record never names a file that is not."""
        self._files.sync()
        self._env.sync(True)

    def _read_outside(self, outside: bytes) -> memoryview:
        """The verified body of a record whose payload is a file (one copy, one hash)."""
        header, head, reference = outside_parts(outside)
        ref = PayloadRef.decode(reference)
        body = self._buffers.take(header.stored_nbytes)
        body[: len(head)] = head
        if not self._files.read_into(ref, body[len(head) :]):
            raise CorruptPayload(f"payload file {ref.name} is missing")
        check_tail(body[len(head) :], header)
        return body

    def _discard_corrupt(self, key: bytes, exc: CorruptPayload, seen: bytes | None = None) -> None:
        """Delete `key` if it still fails verification (a writer may have replaced it): a
        record whose payload is a file (`seen`) if it is still that very record."""
        ref = None
        with self._env.begin(write=True, db=self._db, buffers=True) as txn:
            raw = txn.get(key)
            unchanged = raw is not None and seen is not None and bytes(raw) == seen
            if unchanged or (raw is not None and seen is None and not _verifies(raw)):
                ref = ref_of_value(raw)
                txn.delete(key)
        if ref is not None:
            self._files.remove(ref)
        self._counters.add(checksum_failures=1)
        logger.warning("%s: dropped corrupt record %s: %s", self.name, key.hex(), exc)

    def _collect_payload_files(self) -> None:
        """At open: remove payload files no record names, and records whose file is gone
        (each counted as a checksum failure: read as a miss, never served)."""
        refs: dict[bytes, PayloadRef] = {}
        with self._env.begin(db=self._db, buffers=True) as txn:
            for stored_key, raw in txn.cursor().iternext():
                ref = ref_of_value(raw)
                if ref is not None:
                    refs[bytes(stored_key)] = ref
        missing = self._files.collect(refs.values())
        lost = [key for key, ref in refs.items() if ref.name in missing]
        with self._env.begin(write=True, db=self._db) as txn:
            for key in lost:
                txn.delete(key)
        for key in lost:
            logger.warning(
                "%s: dropped record %s: its payload file is missing", self.name, key.hex()
            )
        self._counters.add(checksum_failures=len(lost))

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable(f"{self.name} tier is closed")


def _lock_directory(path: str) -> int:
    """An exclusive, non-blocking lock on `path`/kvsplice.lock; StoreUnavailable if held.

    NOTE: LMDB itself lets several processes write one environment; two sidecars on one
    directory would each keep a catalog the other's writes invalidate. The lock is
    released by the kernel when the process dies (SIGKILL included): no stale lock.
    """
    lock_path = os.path.join(path, LOCK_FILE)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise StoreUnavailable(
            f"LMDB directory {path} is in use by another kvsplice process ({lock_path} is locked)"
        ) from exc
    return fd


def _disk_holds_map(path: str, map_nbytes: int) -> bool:
    """Whether the disk under `path` can back the whole map. NOTE: under writemap LMDB sizes
    its data file to the map (sparse); a write into a hole the disk cannot fill is SIGBUS,
    not an error, so writemap is used only where the disk holds the whole map."""
    data_file = os.path.join(path, "data.mdb")
    allocated = os.stat(data_file).st_blocks * 512 if os.path.exists(data_file) else 0
    if shutil.disk_usage(path).free + allocated >= map_nbytes:
        return True
    logger.warning(
        "%s: the disk cannot hold a %d-byte map: LMDB writes without writemap", path, map_nbytes
    )
    return False


def _verifies(raw: bytes | memoryview) -> bool:
    try:
        open_record(raw)
    except CorruptPayload:
        return False
    return True
