"""An in-process store: the real grpc.aio server on a background thread with its own loop.

For the demo's embedded store and for tests: loopback (free port) or unix socket;
`stop()` is the same graceful shutdown as SIGTERM. Owns the thread and loop only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace
from typing import Any

from kvsplice.server.app import StoreServer, build
from kvsplice.server.config import ServerConfig
from kvsplice.storage.config import LMDBTierConfig, MemoryTierConfig, StoreConfig

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # a shared tier's catch-up may wait out a failover (30 s)


def loopback_config(
    lmdb_path: str | None,
    *,
    listen_address: str = "127.0.0.1:0",
    memory_bytes: int = 256 << 20,
    **overrides: Any,
) -> ServerConfig:
    """A `ServerConfig` for an embedded store: memory tier over LMDB at `lmdb_path`
    (memory only when None), a 1 s grace period, and any other field overridden."""
    lmdb = None if lmdb_path is None else LMDBTierConfig(path=lmdb_path, sync=False)
    store = StoreConfig(memory=MemoryTierConfig(max_bytes=memory_bytes), lmdb=lmdb)
    base = ServerConfig(listen_address=listen_address, store=store, grace_period_s=1.0)
    return replace(base, **overrides)


class EmbeddedStore:
    """`start()` → serving at `target`; `stop()` → drained and closed. Also a context manager."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._started = threading.Event()
        self._startup_error: BaseException | None = None
        self._server: StoreServer | None = None

    @property
    def target(self) -> str:
        """The address clients dial (`host:port` or `unix:/path`)."""
        if self._server is None:
            raise RuntimeError("EmbeddedStore is not started")
        return self._server.address

    @property
    def admin_url(self) -> str | None:
        """`http://host:port` of the admin API and dashboard (`https://` with TLS); None when
        it is off."""
        if self._server is None:
            raise RuntimeError("EmbeddedStore is not started")
        return self._server.admin_url

    @property
    def server(self) -> StoreServer:
        """The running server (its store, admin API, services)."""
        if self._server is None:
            raise RuntimeError("EmbeddedStore is not started")
        return self._server

    def start(self) -> str:
        """Start serving; returns `target`. Raises what building or starting raised."""
        if self._thread is not None:
            raise RuntimeError("EmbeddedStore already started")
        self._thread = threading.Thread(
            target=self._run, name="kvsplice-embedded-store", daemon=True
        )
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S):
            raise TimeoutError(f"embedded store did not start within {START_TIMEOUT_S} s")
        if self._startup_error is not None:
            self._thread.join()
            self._thread = None
            raise self._startup_error
        return self.target

    def stop(self) -> None:
        """Graceful shutdown (health NOT_SERVING, drain, close the store); idempotent."""
        thread, loop, stop_event = self._thread, self._loop, self._stop_event
        if thread is None or loop is None or stop_event is None:
            return
        loop.call_soon_threadsafe(stop_event.set)
        thread.join()
        self._thread = None

    def __enter__(self) -> EmbeddedStore:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as error:  # reported to start() if it happened while starting
            if not self._started.is_set():
                self._startup_error = error
                self._started.set()
            else:
                logger.exception("embedded store crashed")

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        server = build(self.config)
        try:
            await server.start()
            self._server = server
            self._started.set()
            await self._stop_event.wait()
        finally:
            await server.stop()
