"""Payload files: large segment payloads kept as files beside the LMDB environment, moved
in from a staged put by a rename (the sidecar neither copies nor reads their bytes).

Owns the folder (`<lmdb path>/payloads`), the names and the reference a record holds,
adoption, reading, removal, the fsync of what was adopted, and sweeping orphans at open.
What a record is (`record`), and when the tier syncs (`lmdb_sync`), are not its concern.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import re
import secrets
import stat
import struct
import threading
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass

from kvsplice.common.errors import CorruptPayload
from kvsplice.common.payload_buffer import StagedFile

logger = logging.getLogger(__name__)

PAYLOAD_DIR = "payloads"
_NAME = re.compile(r"^[0-9a-f]{32}$")
_REFERENCE = struct.Struct("<32sQQ")  # file name (hex), offset of the payload, its size
REFERENCE_NBYTES = _REFERENCE.size
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class PayloadRef:
    """Where a record's payload lies: `nbytes` at `offset` of file `name` in the folder."""

    name: str
    offset: int
    nbytes: int

    def encode(self) -> bytes:
        return _REFERENCE.pack(self.name.encode(), self.offset, self.nbytes)

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> PayloadRef:
        if len(raw) != REFERENCE_NBYTES:
            raise CorruptPayload(f"payload reference of {len(raw)} bytes, not {REFERENCE_NBYTES}")
        name, offset, nbytes = _REFERENCE.unpack(raw)
        text = name.decode("ascii", "replace")
        if not _NAME.match(text):
            raise CorruptPayload(f"payload reference names no payload file ({text!r})")
        return cls(text, offset, nbytes)


def payload_dir(lmdb_path: str) -> str:
    return os.path.join(lmdb_path, PAYLOAD_DIR)


def map_payload(lmdb_path: str, ref: PayloadRef) -> memoryview | None:
    """The payload `ref` names, mapped read-only (no copy), or None if its file is gone
    (removed after the caller's snapshot of the record). `CorruptPayload` if it is short.

    NOTE: the mapping outlives a later removal of the file (the kernel keeps the inode).
    """
    try:
        fd = os.open(os.path.join(payload_dir(lmdb_path), ref.name), _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    try:
        end = ref.offset + ref.nbytes
        if os.fstat(fd).st_size < end:
            raise CorruptPayload(f"payload file {ref.name} is shorter than {end} bytes")
        if not ref.nbytes:
            return memoryview(b"")
        mapped = mmap.mmap(fd, end, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    return memoryview(mapped)[ref.offset : end]


class PayloadFiles:
    """The payload folder of one LMDB environment (the writer's side; thread-safe).

    `keep_for_sync`: adopted files stay open until `sync` fsyncs them (and the folder);
    otherwise (no fsync configured) they are left to the kernel's write-back.
    """

    def __init__(self, lmdb_path: str, keep_for_sync: bool) -> None:
        self.path = payload_dir(lmdb_path)
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        self._device = os.stat(self.path).st_dev
        self._keep_for_sync = keep_for_sync
        self._lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._unsynced_fds: list[int] = []
        self._nbytes = 0
        self._refusals_logged: set[str] = set()
        # NOTE: files are unlinked by a thread of their own: freeing a file's pages costs
        # ~ms, which neither the event loop (Delete) nor a put evicting should wait for.
        self._doomed: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._reaper = threading.Thread(target=self._reap, name="payload-reaper", daemon=True)
        self._reaper.start()

    @property
    def nbytes(self) -> int:
        """Payload bytes of the files the records reference."""
        with self._lock:
            return self._nbytes

    def adopt(self, staged: StagedFile, nbytes: int) -> PayloadRef | None:
        """Move the staged file in (a rename; no byte read or copied) as the payload of
        `nbytes` at `staged.offset`; None if it cannot be (another filesystem, moved or
        replaced since it was checked): the caller copies the bytes instead."""
        if staged.device != self._device:
            self._refused("another filesystem", staged.path)
            return None
        name = secrets.token_hex(16)
        target = os.path.join(self.path, name)
        try:
            os.rename(staged.path, target)
        except OSError as error:
            reason = "another filesystem" if error.errno == errno.EXDEV else error.strerror
            self._refused(str(reason), staged.path)
            return None
        fd = self._checked_fd(target, staged, nbytes)
        if fd is None:
            return None
        with self._lock:
            self._nbytes += nbytes
            if self._keep_for_sync:
                self._unsynced_fds.append(fd)
        if not self._keep_for_sync:
            os.close(fd)
        return PayloadRef(name, staged.offset, nbytes)

    def give_back(self, ref: PayloadRef, staged: StagedFile) -> None:
        """Undo `adopt` (its record was not committed): the file goes back where it was."""
        with self._lock:
            self._nbytes -= ref.nbytes
        try:
            os.rename(os.path.join(self.path, ref.name), staged.path)
        except OSError:
            self._unlink(ref.name)

    def read_into(self, ref: PayloadRef, out: memoryview) -> bool:
        """Copy the payload into `out` (its size); False if its file is gone."""
        try:
            fd = os.open(os.path.join(self.path, ref.name), _OPEN_FLAGS)
        except FileNotFoundError:
            return False
        try:
            done = 0
            while done < len(out):
                num_read = os.preadv(fd, [out[done:]], ref.offset + done)
                if num_read == 0:
                    raise CorruptPayload(f"payload file {ref.name} ends {len(out) - done} short")
                done += num_read
        finally:
            os.close(fd)
        return True

    def remove(self, ref: PayloadRef) -> None:
        """The record referencing `ref` is gone: so is its file (unlinked soon; a crash
        before leaves an orphan, collected at the next open)."""
        with self._lock:
            self._nbytes -= ref.nbytes
        self._doomed.put(ref.name)

    def sync(self) -> None:
        """fsync every file adopted so far, then the folder (their names)."""
        with self._sync_lock:
            with self._lock:
                fds, self._unsynced_fds = self._unsynced_fds, []
            try:
                for fd in fds:
                    os.fdatasync(fd)
                if fds:
                    dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    try:
                        os.fsync(dir_fd)
                    finally:
                        os.close(dir_fd)
            finally:
                for fd in fds:
                    os.close(fd)

    def collect(self, refs: Iterable[PayloadRef]) -> set[str]:
        """At open: remove the files no record references (a crash between a rename and
        its commit, or between a record's removal and its file's); returns the names the
        records reference that have no file (their records are lost)."""
        referenced = {ref.name: ref.nbytes for ref in refs}
        present = {name for name in os.listdir(self.path) if _NAME.match(name)}
        for orphan in present - referenced.keys():
            logger.info("%s: removed payload file %s no record references", self.path, orphan)
            self._unlink(orphan)
        with self._lock:
            self._nbytes = sum(n for name, n in referenced.items() if name in present)
        return referenced.keys() - present

    def close(self) -> None:
        """Unlink what waits to be, close what is still open (unsynced files stay as the
        kernel holds them)."""
        self._doomed.put(None)
        self._reaper.join()
        with self._lock:
            fds, self._unsynced_fds = self._unsynced_fds, []
        for fd in fds:
            os.close(fd)

    def _checked_fd(self, target: str, staged: StagedFile, nbytes: int) -> int | None:
        """An fd of the file moved in if it is the one checked (else it is removed)."""
        try:
            fd = os.open(target, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            self._unlink(os.path.basename(target))
            return None
        info = os.fstat(fd)
        end = staged.offset + nbytes
        if (
            (info.st_dev, info.st_ino) != (staged.device, staged.inode)
            or not stat.S_ISREG(info.st_mode)
            or info.st_size < end
        ):
            os.close(fd)
            self._unlink(os.path.basename(target))
            self._refused("replaced since it was checked", staged.path)
            return None
        if info.st_size > end:
            os.ftruncate(fd, end)  # a reused staging file's stale tail is not kept
        return fd

    def _reap(self) -> None:
        while (name := self._doomed.get()) is not None:
            self._unlink(name)

    def _unlink(self, name: str) -> None:
        with suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, name))

    def _refused(self, reason: str, path: str) -> None:
        if reason not in self._refusals_logged:
            self._refusals_logged.add(reason)
            logger.warning(
                "staged payloads are copied into LMDB, not adopted as files (%s: %s, "
                "payload folder %s); logged once per reason",
                reason, path, self.path,
            )  # fmt: skip
