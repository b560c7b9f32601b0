"""Which host this process runs on, as the sidecar and its clients both compute it.

Equal ids mean one machine (one kernel boot): a client may then try the sidecar's
same-host data plane. Containers on one host share it; the file check that follows
(`storage.lmdb_reader`) tells whether they also share the sidecar's files.
"""

from __future__ import annotations

import socket
from pathlib import Path

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_id() -> str:
    """The kernel's boot id where Linux exposes it, else the host name."""
    try:
        return "boot:" + _BOOT_ID.read_text().strip()
    except OSError:
        return "name:" + socket.gethostname()
