"""Staged puts: a payload handed to the sidecar through a file on its host, not a stream.

A client on the sidecar's host writes a put's payload into a file of the sidecar's
staging directory (by default inside the LMDB tier's directory, where the tier adopts the
file as the payload's own by a rename: no copy; else `/dev/shm`) and sends only the header
and the file's name; the sidecar maps the file (no copy) and treats the bytes as
streamed ones (size, fingerprint, tenant checks hold; the checksum is the loads' to verify). Streaming 60 MB
of float32 K/V over loopback gRPC costs ~0.5 CPU-seconds between the two processes;
the file costs the client's copy into it and the store's copy out of it. The client
leaves `HEAD_ROOM_NBYTES` before the payload: the sidecar's private (copy-on-write)
mapping writes a record header there, so header and payload are one value uncopied.

Owns the file names (who made a file, so a dead client's leftovers can be swept) and
the sidecar's read. The client's side is `storeclient.put_staging`.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import time
from pathlib import Path

from kvsplice.common.errors import NotFound
from kvsplice.common.host import is_running
from kvsplice.common.payload_buffer import PayloadBuffer, StagedFile

DEFAULT_STAGING_DIR = "/dev/shm"
# The server's default: inside the LMDB tier's directory where it adopts payload files
# (a rename needs one filesystem), else DEFAULT_STAGING_DIR (`server.data_plane`).
AUTO_STAGING_DIR = "auto"
LMDB_STAGING_DIR = "staging"  # the folder's name inside the LMDB tier's directory
_PREFIX = "kvsplice-staging-"
# NOTE: the random part makes a name unguessable: a client cannot name another's file.
_NAME = re.compile(rf"^{_PREFIX}(\d+)-[0-9a-f]{{32}}$")
HEAD_ROOM_NBYTES = 64 * 1024  # before a staged payload: room for its record's header
# A spare: a removed payload file the sidecar handed back (`storage.payload_files`); a client
# that needs a fresh staging file claims one by renaming it to its own name, and writes into
# pages the page cache already holds (a fresh file's pages cost ~1 s of CPU per GB on ext4).
SPARE_PREFIX = "kvsplice-spare-"
_SPARE = re.compile(rf"^{SPARE_PREFIX}[0-9a-f]{{32}}$")
STALE_AFTER_S = 60.0  # a dead writer's file is left alone this long (clock skew, pid reuse)


class StagingUnreadable(NotFound):
    """A staged payload the sidecar cannot read (bad name, missing, short, not a file;
    NOT_FOUND on the wire, which a put has no other use for: the client streams instead)."""


def new_name(pid: int | None = None) -> str:
    """A fresh staging file name for process `pid` (this one by default)."""
    return f"{_PREFIX}{os.getpid() if pid is None else pid}-{secrets.token_hex(16)}"


def spare_name() -> str:
    return f"{SPARE_PREFIX}{secrets.token_hex(16)}"


def is_spare(name: str) -> bool:
    return bool(_SPARE.match(name))


def claim_spare(staging_dir: str, path: str) -> bool:
    """Rename one spare of `staging_dir` to `path` (atomic: of clients racing for one spare,
    one wins); False when none is left."""
    try:
        with os.scandir(staging_dir) as entries:
            spares = [entry.name for entry in entries if is_spare(entry.name)]
    except OSError:
        return False
    for name in spares:
        try:
            os.rename(os.path.join(staging_dir, name), path)
        except OSError:  # claimed by another client first
            continue
        return True
    return False


def default_staging_dir() -> str:
    """`/dev/shm` where this host has a writable one, else "" (staged puts off)."""
    path = DEFAULT_STAGING_DIR
    return path if os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK) else ""


def map_staged(staging_dir: str, name: str, offset: int, nbytes: int) -> PayloadBuffer:
    """Staging file `name` up to the `nbytes` at `offset`, mapped privately: the payload is
    `[offset:]`, what is before it writable scratch (copy-on-write: the file never
    changes), and the file it lies in (`staged`: a durable tier may adopt it).
    StagingUnreadable if the name is not a staging name, the file is not a regular file
    or is too short.

    NOTE: the pages are the client's until the sidecar writes one: a client that changes
    its payload after sending the put stores a record that fails verification on every
    read (a miss); one that truncates the file kills the sidecar (SIGBUS), which a
    process of the sidecar's own user (the file is 0600) could do by other means anyway.
    """
    if not staging_dir:
        raise StagingUnreadable("this sidecar takes no staged puts (no staging directory)")
    if not _NAME.match(name):
        raise StagingUnreadable(f"{name!r} is not a staging file name")
    path = os.path.join(staging_dir, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise StagingUnreadable(f"cannot open staged payload {path}: {error.strerror}") from error
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StagingUnreadable(f"staged payload {path} is not a regular file")
        if offset < 0 or offset + nbytes > info.st_size:
            raise StagingUnreadable(
                f"staged payload {path} holds {info.st_size} bytes, "
                f"{nbytes} wanted at offset {offset}"
            )
        mapped = mmap.mmap(fd, offset + nbytes, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)  # the mapping stays
    staged = StagedFile(path, info.st_dev, info.st_ino, offset)
    return PayloadBuffer(memoryview(mapped), offset, staged)  # unmapped once no view is left


def sweep_stale(staging_dir: str | None, now_s: float | None = None) -> int:
    """Remove staging files whose writer died (a killed engine cannot clean up);
    returns how many. Files of live processes, and recent ones, stay."""
    if not staging_dir:
        return 0
    now_s = time.time() if now_s is None else now_s
    removed = 0
    try:
        entries = list(Path(staging_dir).iterdir())
    except OSError:
        return 0
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None or is_running(int(match.group(1))):
            continue
        try:
            if now_s - entry.lstat().st_mtime < STALE_AFTER_S:
                continue
            entry.unlink()
            removed += 1
        except OSError:  # gone already, or another user's: not ours to remove
            continue
    return removed
