"""The sidecar's pid file (`serve --pid-file`): checked before start, written once it listens,
removed on a clean exit. A service manager or `kill -HUP "$(cat FILE)"` reads it.

Owns the file only; signals are `app`'s.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvsplice.common.errors import ServeRefused
from kvsplice.common.host import is_running

logger = logging.getLogger(__name__)


def check_pid_file(path: Path) -> None:
    """ServeRefused if `path` cannot be written, or holds the pid of a process still running
    (another sidecar, most likely). A file left by a process that is gone is stale: reused."""
    if path.is_dir():
        raise ServeRefused(f"pid file {path} is a directory")
    directory = path.parent
    if not directory.is_dir():
        raise ServeRefused(f"pid file {path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ServeRefused(f"pid file {path}: directory {directory} is not writable")
    pid = read_pid(path)
    if pid is not None and pid != os.getpid() and is_running(pid):
        raise ServeRefused(
            f"pid file {path} holds pid {pid}, a running process (another sidecar?): "
            "stop it, or remove the file if that pid is not a kvsplice sidecar"
        )


def read_pid(path: Path) -> int | None:
    """The pid `path` holds, or None (no file, or not one decimal pid)."""
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    except OSError as error:
        raise ServeRefused(f"pid file {path}: {error.strerror}") from error
    return int(text) if text.isdigit() and int(text) > 0 else None


def write_pid_file(path: Path) -> None:
    """Write this process's pid atomically (a reader never sees a partial file)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(f"{os.getpid()}\n")
    os.replace(partial, path)
    logger.info("pid %d written to %s", os.getpid(), path)


def remove_pid_file(path: Path) -> None:
    """Remove `path` if it still holds this process's pid (a successor's file stays)."""
    try:
        if read_pid(path) == os.getpid():
            path.unlink()
    except (OSError, ServeRefused) as error:  # exiting anyway: say so, do not mask the exit
        logger.warning("pid file %s not removed: %s", path, error)
