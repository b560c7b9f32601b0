"""Wiring of the store sidecar: `build(config)` constructs everything, `serve(config)` runs it.

SIGTERM → `StoreServer.stop()`: health NOT_SERVING, in-flight RPCs drain for
`grace_period_s`, reported reuse is written, the store (LMDB) closes; SIGHUP re-reads the
tenants file. Call `build` inside the loop that serves.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvsplice.common.errors import ServeRefused
from kvsplice.common.staging import sweep_stale
from kvsplice.index.exact_index import ExactIndex
from kvsplice.index.similarity_index import SimilarityIndex
from kvsplice.server import shared_follower
from kvsplice.server.admin import AdminServer, build_admin_app, run_admin
from kvsplice.server.admin_models import SharedTierOut
from kvsplice.server.admin_source import StoreAdminSource
from kvsplice.server.anchor_service import AnchorService
from kvsplice.server.capacity_metrics import NamespacePressureCollector
from kvsplice.server.config import ServerConfig, TlsConfig
from kvsplice.server.data_plane import describe_data_plane
from kvsplice.server.interceptors import FaultInterceptor, TenantAuthInterceptor
from kvsplice.server.kv_event_publisher import KvEventPublisher
from kvsplice.server.listen_checks import bind_failure, check_serve
from kvsplice.server.metrics import StoreMetrics
from kvsplice.server.pid_file import remove_pid_file, write_pid_file
from kvsplice.server.segment_service import SegmentService
from kvsplice.server.servicer import RPC_METHODS, SERVICE_NAME, SegmentStoreServicer, add_to_server
from kvsplice.server.tenants import Authenticator
from kvsplice.server.upload_budget import UploadBudget
from kvsplice.storage.config import StoreConfig, build_store
from kvsplice.storage.tiered_store import TieredStore

logger = logging.getLogger(__name__)


@dataclass
class StoreServer:
    """A built sidecar; `address` is the bound target once `start()` returned."""

    config: ServerConfig
    server: aio.Server
    health: health_aio.HealthServicer
    store: TieredStore
    segments: SegmentService
    anchors: AnchorService
    metrics: StoreMetrics
    address: str
    authenticator: Authenticator
    uploads: UploadBudget
    admin: AdminServer | None = None
    sweeper: asyncio.Task[None] | None = None
    follower: asyncio.Task[None] | None = None
    persister: asyncio.Task[None] | None = None
    kv_events: KvEventPublisher | None = None
    staging_dir: str = ""  # where clients on this host stage puts ("": nowhere)

    async def start(self) -> None:
        num_segments = self.segments.rebuild_indexes()
        num_segments += await shared_follower.catch_up(self.store, self.config.catch_up_timeout_s)
        await self.server.start()
        self.sweeper = asyncio.create_task(self._sweep_expired(), name="kvsplice-ttl-sweeper")
        self.persister = asyncio.create_task(self._persist_reported(), name="kvsplice-persister")
        if self.store.shared is not None:
            self.follower = asyncio.create_task(
                shared_follower.follow(self.store), name="kvsplice-shared-follower"
            )
        # NOTE: a degraded shared tier never changes health: local tiers keep serving.
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if self.config.admin_port is not None:
            source = StoreAdminSource(self.store, self.segments, self.anchors)
            app = build_admin_app(
                source,
                self.metrics,
                authenticator=self.authenticator,
                shared_status=self._shared_status,
            )
            address = f"{self.config.admin_host}:{self.config.admin_port}"
            try:
                self.admin = await run_admin(
                    app, self.config.admin_host, self.config.admin_port, tls=self.config.tls
                )
            except BaseException as error:  # e.g. the port was taken: nothing half-started
                await self.server.stop(0)
                self.store.close()
                if self.kv_events is not None:
                    self.kv_events.close()
                if isinstance(error, OSError):
                    raise ServeRefused(f"cannot listen on {address}: {error.strerror}") from error
                raise
        logger.info("%s; %d segments indexed", startup_line(self), num_segments)

    async def stop(self) -> None:
        """Graceful shutdown: NOT_SERVING, drain in-flight RPCs (bounded), close the store."""
        logger.info("shutting down: draining RPCs for up to %.1f s", self.config.grace_period_s)
        await self.health.enter_graceful_shutdown()
        self.segments.mark_draining()
        for task in (self.sweeper, self.follower, self.persister):
            if task is not None:
                task.cancel()
        try:
            await self.server.stop(self.config.grace_period_s)
            if self.admin is not None:
                await self.admin.stop()
            await self.segments.reported.persist()  # what the drained RPCs reported last
            shared = self.store.shared
            if shared is not None and not shared.status().degraded:
                # share what was acked but not yet published (a degraded tier takes nothing)
                await asyncio.to_thread(shared.wait_published, self.config.grace_period_s)
        finally:
            self.store.close()
            if self.kv_events is not None:
                self.kv_events.close()
        logger.info("kvsplice store stopped")

    @property
    def admin_url(self) -> str | None:
        """The admin API's URL as served (`https://` with TLS); None while it is off."""
        if self.admin is None:
            return None
        scheme = "http" if self.config.tls is None else "https"
        return f"{scheme}://{_bracketed(self.admin.host)}:{self.admin.port}"

    def _shared_status(self) -> SharedTierOut | None:
        status = self.store.shared_status()
        if status is None:
            return None
        return shared_follower.status_out(status)

    async def _persist_reported(self) -> None:
        """Write reported reuse into the tiers every `persist_interval_s`."""
        while True:
            await asyncio.sleep(self.config.persist_interval_s)
            await self.segments.reported.persist()

    async def _sweep_expired(self) -> None:
        """Reclaim expired segments now and then (reads also drop them lazily), and the
        staging files of clients that died without removing theirs."""
        while True:
            num_files = await asyncio.to_thread(sweep_stale, self.staging_dir)
            if num_files:
                logger.info("removed %d staging files of exited clients", num_files)
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                num_removed = self.store.sweep_expired()
            except Exception:  # the next sweep retries; serving goes on meanwhile
                logger.exception("TTL sweep failed")
                continue
            if num_removed:
                logger.info("TTL sweep removed %d expired segments", num_removed)


def startup_line(app: StoreServer) -> str:
    """Listen addresses, tiers with their budgets and auth, in one line."""
    admin = f"admin+dashboard {app.admin_url}" if app.admin_url else "admin off"
    tiers = " -> ".join(_tier_summary(app.config.store))
    auth = "tenants" if app.config.tenants_path else "on" if app.config.auth_token else "off"
    if app.config.tls is not None:
        auth += ", mtls" if app.config.tls.client_ca_path else ", tls"
    events = "" if app.kv_events is None else f"; kv events {app.kv_events.endpoint}"
    return f"kvsplice serving: grpc {app.address}, {admin}; tiers {tiers}; auth {auth}{events}"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _tier_summary(store: StoreConfig) -> list[str]:
    parts = []
    if store.memory is not None:
        parts.append(f"memory {_mib(store.memory.max_bytes)} {store.memory.policy}")
    if store.lmdb is not None:
        parts.append(f"lmdb {_mib(store.lmdb.map_size_bytes)} at {store.lmdb.path}")
    if store.redis is not None:
        budget = _mib(store.redis.max_bytes) if store.redis.max_bytes else "unbounded"
        kind = "redis cluster" if store.redis.cluster else "redis"
        parts.append(f"shared {kind} {budget} at {redact_url(store.redis.url)}")
    return parts


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):g} MiB"


def redact_url(url: str) -> str:
    """A Redis URL without its password (startup lines end up in log collectors)."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    user = credentials.split(":", 1)[0]
    return f"{scheme}://{user + ':' if user else ''}***@{host}"


def _bind(server: aio.Server, listen_address: str, tls: TlsConfig | None) -> str:
    """Listen on `listen_address` (TLS when configured); ServeRefused with the cause if
    gRPC binds nothing (`check_serve` ran first, so this is a race or a gRPC refusal)."""
    try:
        if tls is None:
            port = server.add_insecure_port(listen_address)
        else:
            port = server.add_secure_port(listen_address, _server_credentials(tls))
    except RuntimeError as error:  # grpc: "Failed to bind to address ..."
        port, cause = 0, str(error)
    else:
        cause = "gRPC bound nothing (its log line above says why)"
    if port == 0:
        raise ServeRefused(
            f"cannot listen on {listen_address}: {bind_failure(listen_address) or cause}"
        )
    if listen_address.startswith("unix:"):
        return listen_address
    host = listen_address.rsplit(":", 1)[0]
    return f"{host}:{port}"


def _server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    client_ca = Path(tls.client_ca_path).read_bytes() if tls.client_ca_path else None
    return grpc.ssl_server_credentials(
        [(Path(tls.key_path).read_bytes(), Path(tls.cert_path).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def build(config: ServerConfig) -> StoreServer:
    """Construct the store, indexes, services, gRPC server and interceptors (not started)."""
    check_serve(config)  # before the store opens anything on disk: one clear line
    authenticator = Authenticator(
        Path(config.tenants_path) if config.tenants_path else None, config.auth_token
    )
    store = build_store(config.store)
    try:
        exact, similar = ExactIndex(config.exact_index), SimilarityIndex(config.similarity)
        segments = SegmentService(store, exact, similar, config.service)
        anchors = AnchorService(store, config.anchor_pool, config.service)
        metrics = StoreMetrics(RPC_METHODS)
        metrics.bind_store(store.stats)
        metrics.registry.register(NamespacePressureCollector(store.namespace_pressure))
        uploads = UploadBudget(config.max_inflight_upload_nbytes, config.stream_idle_timeout_s)
        data_plane = describe_data_plane(config.store, config.staging_dir)
        servicer = SegmentStoreServicer(
            segments, anchors, metrics, config.chunk_nbytes, data_plane, authenticator, uploads
        )
        server, health = _grpc_server(config, servicer, metrics, authenticator)
        address = _bind(server, config.listen_address, config.tls)
        kv_events = None if config.kv_events is None else KvEventPublisher(config.kv_events)
    except BaseException:
        store.close()
        raise
    if kv_events is not None:
        segments.add_index_watcher(kv_events)
    return StoreServer(
        config, server, health, store, segments, anchors, metrics, address, authenticator, uploads,
        kv_events=kv_events, staging_dir=data_plane.staging_dir,
    )  # fmt: skip


def _grpc_server(
    config: ServerConfig,
    servicer: SegmentStoreServicer,
    metrics: StoreMetrics,
    authenticator: Authenticator,
) -> tuple[aio.Server, health_aio.HealthServicer]:
    """The aio server with its interceptors (faults outermost, then auth) and services."""
    interceptors: list[aio.ServerInterceptor] = [FaultInterceptor(metrics)]
    if authenticator.enabled:
        interceptors.append(TenantAuthInterceptor(authenticator))
    limit = config.max_message_nbytes
    server = aio.server(
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", limit),
            # NOTE: gRPC sets SO_REUSEPORT by default, so a second sidecar would bind the
            # same port and take half the connections to a store of its own.
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    add_to_server(servicer, server)  # chunk frames bypass protobuf copies on Put/GetSegment
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if config.enable_reflection:
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_name, reflection.SERVICE_NAME), server
        )
    return server, health


async def run_until_signalled(config: ServerConfig) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully."""
    app = build(config)
    await app.start()
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_requested.set)
    loop.add_signal_handler(signal.SIGHUP, app.authenticator.reload)
    pid_file = Path(config.pid_file) if config.pid_file else None
    try:
        if pid_file is not None:  # NOTE: after the signal handlers: a HUP it invites is handled
            write_pid_file(pid_file)
        await stop_requested.wait()
    finally:
        await app.stop()
        if pid_file is not None:
            remove_pid_file(pid_file)


def serve(config: ServerConfig) -> None:
    """Entry point for `kvsplice serve`: run the sidecar in this process until signalled."""
    asyncio.run(run_until_signalled(config))
