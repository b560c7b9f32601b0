"""Payload files: large segment payloads kept as files beside the LMDB environment, moved
in from a staged put by a rename (the sidecar neither copies nor reads their bytes).

Owns the folder (`<lmdb path>/payloads`), the names and the reference a record holds,
adoption, reading, removal (a removed file goes back to the staging folder as a spare for
the next put where no reader maps it and the budget has room), the fsync of what was
adopted, and sweeping orphans at open. What a record is (`record`), and when the tier
syncs (`lmdb_sync`), are not its concern.

NOTE: readers take a shared `flock` on a file before they map it and hold it as long as the
mapping lives (the mapping's own descriptor holds it); a file is handed back as a spare only
under an exclusive one. A spare is rewritten by its next client: a mapping of it would
change under its reader after its checksum was verified.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import queue
import re
import secrets
import stat
import struct
import threading
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass

from kvsplice.common.errors import CorruptPayload
from kvsplice.common.payload_buffer import StagedFile
from kvsplice.common.staging import LMDB_STAGING_DIR, is_spare, spare_name
from kvsplice.storage.record import HEADER_NBYTES, read_header, tail_outside

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


def ref_of_value(raw: bytes | memoryview | None) -> PayloadRef | None:
    """The payload file a stored value names (None: none, or unreadable).

    NOTE: the head is not verified: a record with a corrupt head still names its file.
    """
    if raw is None or not tail_outside(raw):
        return None
    try:
        return PayloadRef.decode(memoryview(raw)[HEADER_NBYTES + read_header(raw).head_nbytes :])
    except CorruptPayload:
        return None


def payload_dir(lmdb_path: str) -> str:
    return os.path.join(lmdb_path, PAYLOAD_DIR)


def map_payload(lmdb_path: str, ref: PayloadRef) -> memoryview | None:
    """The payload `ref` names, mapped read-only (no copy), or None if its file is gone
    (removed after the caller's snapshot of the record). `CorruptPayload` if it is short.

    NOTE: the mapping outlives a later removal of the file (the kernel keeps the inode).
    """
    path = os.path.join(payload_dir(lmdb_path), ref.name)
    fd = _open_shared(path)
    if fd is None:
        return None
    try:
        end = ref.offset + ref.nbytes
        if os.fstat(fd).st_size < end:
            raise CorruptPayload(f"payload file {ref.name} is shorter than {end} bytes")
        if not ref.nbytes:
            return memoryview(b"")
        mapped = mmap.mmap(fd, end, access=mmap.ACCESS_READ)  # its own dup: the lock stays
    finally:
        os.close(fd)
    return memoryview(mapped)[ref.offset : end]


def _open_shared(path: str) -> int | None:
    """`path` opened and share-locked (no one may hand it back as a spare meanwhile), or
    None if it is gone: removed, or being handed back (its name no longer leads to it)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            return fd
    except OSError:  # BlockingIOError: handed back right now; FileNotFoundError: gone
        pass
    os.close(fd)
    return None


class PayloadFiles:
    """The payload folder of one LMDB environment (the writer's side; thread-safe).

    `keep_for_sync`: adopted files stay open until `sync` fsyncs them (and the folder);
    otherwise (no fsync configured) they are left to the kernel's write-back. `spare_room`:
    how many bytes spares may hold now (the tier's budget left: files and spares together
    stay within it); spares go to the LMDB directory's staging folder where it exists.
    """

    def __init__(
        self, lmdb_path: str, keep_for_sync: bool, spare_room: Callable[[], int] | None = None
    ) -> None:
        self.path = payload_dir(lmdb_path)
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        self._spare_dir = os.path.join(lmdb_path, LMDB_STAGING_DIR)
        self._spare_room = spare_room
        self._remove_spares()  # an earlier run's: their bytes are counted nowhere
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
        fd = _open_shared(os.path.join(self.path, ref.name))
        if fd is None:
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
        """Unlink what waits to be and the spares, close what is still open (unsynced files
        stay as the kernel holds them)."""
        self._doomed.put(None)
        self._reaper.join()
        self._remove_spares()
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
            if not self._handed_back(name):
                self._unlink(name)

    def _handed_back(self, name: str) -> bool:
        """Whether removed file `name` became a spare (no reader maps it, room is left)."""
        if self._spare_room is None or not os.path.isdir(self._spare_dir):
            return False
        path = os.path.join(self.path, name)
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError:
            return False
        try:
            if os.fstat(fd).st_size > self._spare_room() - self._spares_nbytes():
                return False
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: mapped
            os.rename(path, os.path.join(self._spare_dir, spare_name()))
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def _spares(self) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(self._spare_dir) as entries:
                return [entry for entry in entries if is_spare(entry.name)]
        except OSError:
            return []

    def _spares_nbytes(self) -> int:
        nbytes = 0
        for entry in self._spares():
            with suppress(OSError):
                nbytes += entry.stat(follow_symlinks=False).st_size
        return nbytes

    def _remove_spares(self) -> None:
        for entry in self._spares():
            with suppress(OSError):
                os.unlink(entry.path)

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
