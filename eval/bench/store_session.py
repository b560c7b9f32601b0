"""The store a run talks to: a given sidecar, or an embedded one started for the run.

Owns `StoreSession` and `open_store` (start and stop of an in-process store on
loopback, optionally with LMDB and the admin HTTP API) and the per-namespace
stats snapshot. What is stored, and when, is the reuse engine's business.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvsplice.common.namespace_stats import NamespaceStats
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storeclient.client import StoreClient

logger = logging.getLogger(__name__)

ADMIN_HOST = "127.0.0.1"
# NOTE: unquantized SmolLM2 K/V is 46 KB per token, and a 5-agent sample stores
# thousands of tokens per mode; a small budget evicts the template segments that
# later samples should hit, which would understate reuse.
DEFAULT_MEMORY_BYTES = 2 << 30


@dataclass(frozen=True)
class StoreSession:
    """Where the store is. `admin_url` is set only for an embedded store with its admin API."""

    target: str
    embedded: bool
    admin_url: str | None = None
    lmdb_path: Path | None = None

    def stats_url(self, namespace: str) -> str | None:
        """The admin API's stats of `namespace` (while the store runs), if there is one."""
        return (
            None if self.admin_url is None else f"{self.admin_url}/v1/stats?namespace={namespace}"
        )


@contextmanager
def open_store(
    target: str | None,
    *,
    lmdb_path: Path | None = None,
    admin: bool = False,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
) -> Iterator[StoreSession]:
    """`target` as is, or (None) an embedded store for the duration of the `with` block.

    The embedded store keeps a memory tier of `memory_bytes`, over LMDB at
    `lmdb_path` when given, and serves the admin API on a free loopback port
    when `admin`.
    """
    if target is not None:
        yield StoreSession(target, embedded=False)
        return
    admin_port = free_port(ADMIN_HOST) if admin else None
    lmdb = None if lmdb_path is None else str(lmdb_path)
    config = loopback_config(
        lmdb, memory_bytes=memory_bytes, admin_host=ADMIN_HOST, admin_port=admin_port
    )
    with EmbeddedStore(config) as store:
        admin_url = None if admin_port is None else f"http://{ADMIN_HOST}:{admin_port}"
        logger.info("embedded store on %s (admin API: %s)", store.target, admin_url or "off")
        yield StoreSession(store.target, embedded=True, admin_url=admin_url, lmdb_path=lmdb_path)


def free_port(host: str) -> int:
    """A port free right now on `host` (another process could take it before we bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def namespace_stats(
    target: str, namespaces: Sequence[str], token: str | None = None
) -> dict[str, NamespaceStats | None]:
    """Segments, bytes, hits and misses per namespace (None where the store did not answer)."""
    snapshot: dict[str, NamespaceStats | None] = {}
    for namespace in namespaces:
        with StoreClient(target, namespace, token=token) as client:
            snapshot[namespace] = client.stats()
    return snapshot


def stats_json(snapshot: Mapping[str, NamespaceStats | None]) -> dict[str, dict[str, Any] | None]:
    """`namespace_stats`' snapshot as results files hold it: each `NamespaceStats` as a dict."""
    return {name: None if stats is None else asdict(stats) for name, stats in snapshot.items()}
