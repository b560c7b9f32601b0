"""The client's side of staged puts (`common.staging`): one reusable file per process.

On the sidecar's host a put's payload is copied into this process's staging file (in
the sidecar's staging folder, /dev/shm by default) and the put names the file instead
of streaming the bytes. The file is created once (mode 0600: only this user's sidecar
reads it), grown when a payload outgrows it, reused by every put (its pages stay
mapped: no fresh memory per put) and removed on close; a killed process's file is
swept by the sidecar. One put at a time uses it: a put that finds it busy streams.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from kvsplice.common.host import host_id
from kvsplice.common.staging import HEAD_ROOM_NBYTES, new_name
from kvsplice.storeclient.results import DataPlaneInfo

logger = logging.getLogger(__name__)

# Smaller payloads stream: a file write plus its RPC saves nothing on a few KiB.
MIN_STAGED_NBYTES = 256 * 1024
_GROWTH_NBYTES = 1 << 20


class PutStaging:
    """This process's staging file in `directory`, written by one put at a time."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._name = new_name(self._pid)
        self._fd: int | None = None
        self._map: mmap.mmap | None = None

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
        """False in a child forked after the open (the mapping is the parent's)."""
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
                target = self._reserve(offset + view.nbytes)
            except OSError as error:  # the folder is full (or gone): this put streams
                logger.warning("cannot stage a %d-byte put (%s): streaming it", view.nbytes, error)
                yield None
                return
            target[offset : offset + view.nbytes] = view
            yield self._name, offset
        finally:
            self._lock.release()

    def close(self) -> None:
        """Remove the file (a forked child leaves its parent's alone)."""
        with self._lock:
            if self._map is not None and self.usable:
                self._map.close()
            if self._fd is not None and self.usable:
                os.close(self._fd)
                _remove(os.path.join(self.directory, self._name), self._pid)
            self._map, self._fd = None, None

    def _reserve(self, nbytes: int) -> mmap.mmap:
        """The mapping, at least `nbytes` long (the file is created or grown here)."""
        if self._map is not None and len(self._map) >= nbytes:
            return self._map
        if self._fd is None:
            path = os.path.join(self.directory, self._name)
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            self._fd = os.open(path, flags, 0o600)
            weakref.finalize(self, _remove, path, self._pid)  # at exit, if never closed
        if self._map is not None:
            self._map.close()
        self._map = None
        size = -(-nbytes // _GROWTH_NBYTES) * _GROWTH_NBYTES
        # NOTE: allocated before it is mapped: a write into an unbacked page of a full
        # tmpfs is SIGBUS (the engine dies); fallocate says ENOSPC instead.
        os.posix_fallocate(self._fd, 0, size)
        self._map = mmap.mmap(self._fd, size)
        return self._map


def _remove(path: str, pid: int) -> None:
    """Remove the staging file at `path` from the process `pid` that made it (a forked
    child exiting leaves its parent's file alone)."""
    if os.getpid() == pid:
        with suppress(FileNotFoundError):
            os.unlink(path)
