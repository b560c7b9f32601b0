"""Which host (and PID namespace) this process runs in, as the sidecar and its clients
both compute it.

Equal ids mean one kernel boot and one PID namespace: a client may then try the
sidecar's same-host data plane. LMDB tracks its readers by pid, so processes in
different PID namespaces (separate containers) must not share an environment and
read over gRPC instead. The file check that follows (`storage.lmdb_reader`) tells
whether the client also sees the sidecar's files.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_PID_NAMESPACE = "/proc/self/ns/pid"


def host_id() -> str:
    """The kernel's boot id and PID namespace where Linux exposes them, else the host name."""
    try:
        boot = _BOOT_ID.read_text().strip()
        return f"boot:{boot}/{os.readlink(_PID_NAMESPACE)}"
    except OSError:
        return "name:" + socket.gethostname()


def is_running(pid: int) -> bool:
    """Whether process `pid` exists in this PID namespace (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
