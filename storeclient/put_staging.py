"""The client's side of staged puts (`common.staging`): one reusable file per process.

On the sidecar's host a put's payload is copied into this process's staging file (in
the sidecar's staging folder) and the put names the file instead of streaming the
bytes. The file (mode 0600: only this user's sidecar reads it) is written with one
`pwrite` and reused by the next put, unless the sidecar adopted it as the payload's
file (it moved it away: the next is a spare the sidecar handed back, claimed by a rename,
else a fresh one); it is removed on close, and a killed
process's file is swept by the sidecar. One put at a time uses it: a put that finds
it busy streams.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from kvsplice.common.host import host_id
from kvsplice.common.staging import HEAD_ROOM_NBYTES, claim_spare, new_name
from kvsplice.storeclient.results import DataPlaneInfo

logger = logging.getLogger(__name__)

# Smaller payloads stream: a file write plus its RPC saves nothing on a few KiB.
MIN_STAGED_NBYTES = 256 * 1024


class PutStaging:
    """This process's staging file in `directory`, written by one put at a time."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._file = _StagingFile(directory, self._pid)
        weakref.finalize(self, _StagingFile.remove, self._file, self._pid)  # at exit

    @classmethod
    def open(cls, plane: DataPlaneInfo) -> PutStaging | None:
        """Staging for the sidecar described by `plane`; None: it is elsewhere or takes none."""
        directory = plane.staging_dir
        if not directory or plane.host_id != host_id() or plane.server_pid == os.getpid():
            return None
        if not (os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)):
            logger.info("cannot write the sidecar's staging folder %s: puts stream", directory)
            return None
        return cls(directory)

    @property
    def usable(self) -> bool:
        """False in a child forked after the open (the file is the parent's)."""
        return os.getpid() == self._pid

    @contextmanager
    def staged(self, payload: bytes | memoryview) -> Iterator[tuple[str, int] | None]:
        """`payload` written into the file, as (name, offset), for the duration of the
        block (the put must finish inside it); None when another put holds the file."""
        if not self._lock.acquire(blocking=False):
            yield None
            return
        try:
            view = memoryview(payload).cast("B")
            offset = HEAD_ROOM_NBYTES  # the sidecar writes the record's header there
            try:
                self._file.write(view, offset)
            except OSError as error:  # the folder is full (or gone): this put streams
                logger.warning("cannot stage a %d-byte put (%s): streaming it", view.nbytes, error)
                yield None
                return
            try:
                yield os.path.basename(self._file.path), offset
            finally:
                if self._file.adopted():  # the sidecar keeps it: the next put needs its own
                    self._file.renew()
        finally:
            self._lock.release()

    def close(self) -> None:
        """Remove the file (a forked child leaves its parent's alone)."""
        with self._lock:
            if self.usable:
                self._file.remove(self._pid)


class _StagingFile:
    """The current staging file of process `pid`, created by its first write."""

    def __init__(self, directory: str, pid: int) -> None:
        self._directory = directory
        self.path = os.path.join(directory, new_name(pid))
        self._fd: int | None = None
        self._inode = 0

    def renew(self) -> None:
        """Let go of an adopted file (it is the sidecar's now); the next write makes one."""
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None
        self.path = os.path.join(self._directory, new_name())

    def write(self, view: memoryview, offset: int) -> None:
        """`view` at `offset` (NOTE: `pwrite`, not a mapping: a full tmpfs answers ENOSPC,
        where a write through a map of an unbacked page is SIGBUS; and a fresh file's
        pages cost no page fault each)."""
        if self._fd is None:
            claimed = claim_spare(self._directory, self.path)
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
            flags |= 0 if claimed else os.O_CREAT | os.O_EXCL
            self._fd = os.open(self.path, flags, 0o600)
            self._inode = os.fstat(self._fd).st_ino
        done = 0
        while done < view.nbytes:
            done += os.pwrite(self._fd, view[done:], offset + done)

    def adopted(self) -> bool:
        """Whether the file left its name (the sidecar moved it in as a payload file)."""
        try:
            return os.stat(self.path).st_ino != self._inode
        except FileNotFoundError:
            return True

    def remove(self, pid: int) -> None:
        """Close and remove the file, from the process `pid` that made it (a forked child
        exiting leaves its parent's file alone)."""
        if os.getpid() != pid:
            return
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if not self.adopted():
                with suppress(FileNotFoundError):
                    os.unlink(self.path)
