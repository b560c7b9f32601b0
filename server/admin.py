"""The admin HTTP API (health, readiness, metrics, per-namespace stats, segments, delete, flush).

Owns the FastAPI app, its tenant guard (`tenant_guard`, a dependency other pages reuse)
and an embedded uvicorn runner (TLS/mTLS when configured) that shares the gRPC server's
event loop. It reads the store only through `AdminSource`; choosing host, port and
credentials (default 127.0.0.1, no auth) is the entry point's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse

from kvsplice.common.errors import KvspliceError, PermissionDenied
from kvsplice.common.log_limits import RateLimitedLog
from kvsplice.common.segment import validate_namespace
from kvsplice.server.admin_models import (
    AdminSource,
    DeletedOut,
    FlushOut,
    SegmentPageOut,
    SharedTierOut,
    StatsOut,
    StatusOut,
    stats_row,
)
from kvsplice.server.config import TlsConfig
from kvsplice.server.dashboard import add_dashboard
from kvsplice.server.metrics import StoreMetrics, package_version
from kvsplice.server.tenants import Authenticator, Tenant

logger = logging.getLogger(__name__)
_refusals_log = RateLimitedLog(logger, interval_s=10.0)

DEFAULT_PAGE_LIMIT = 100
MAX_PAGE_LIMIT = 1000
MAX_PAGE_OFFSET = 1 << 31
GRACEFUL_SHUTDOWN_S = 5
# gRPC status name (KvspliceError.status_name) -> HTTP status; anything else is a 500.
HTTP_STATUS_OF = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "FAILED_PRECONDITION": 409,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
}


def tenant_guard(authenticator: Authenticator) -> Callable[..., Tenant]:
    """A FastAPI dependency: the caller's tenant, or HTTP 401 (no or unknown bearer token).

    Pages that show a namespace then call `Authenticator.authorize` (403 when refused).
    """

    def require_tenant(authorization: Annotated[str | None, Header()] = None) -> Tenant:
        try:
            return authenticator.authenticate(authorization)
        except KvspliceError as exc:
            raise HTTPException(
                401, "missing or unknown bearer token", headers={"WWW-Authenticate": "Bearer"}
            ) from exc

    return require_tenant


def admin_guard(authenticator: Authenticator) -> Callable[..., Tenant]:
    """`tenant_guard`, then 403 unless the tenant is an admin (pages about every namespace)."""
    caller = Depends(tenant_guard(authenticator))

    def require_admin(tenant: Tenant = caller) -> Tenant:
        if not tenant.is_admin:
            raise PermissionDenied(f"tenant {tenant.name!r} is a {tenant.role}: admin only")
        return tenant

    return require_admin


def _checked_namespace(namespace: str) -> str:
    try:
        return validate_namespace(namespace)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from exc


async def _kvsplice_error_response(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, KvspliceError)
    status = HTTP_STATUS_OF.get(exc.status_name, 500)
    if status >= 500:
        logger.error("admin %s failed", request.url.path, exc_info=exc)
    else:  # the caller's fault: at most one line per path and status every 10 s
        _refusals_log.log(
            (request.url.path, status), logging.INFO, "admin %s refused: %s", request.url.path, exc
        )
    return JSONResponse({"detail": str(exc), "code": exc.status_name}, status_code=status)


def build_admin_app(
    source: AdminSource,
    metrics: StoreMetrics,
    *,
    authenticator: Authenticator | None = None,
    token: str | None = None,
    version: str | None = None,
    shared_status: Callable[[], SharedTierOut | None] = lambda: None,
) -> FastAPI:
    """The admin app. With credentials (`authenticator`, or one admin `token`), everything
    but `/healthz` and `/readyz` needs `Authorization: Bearer <token>`: `/v1/*` serves a
    tenant only its namespaces (403 for others; deletes need a writer), `/metrics` and
    `/dashboard` are admin only (they show every namespace), `/openapi.json` any tenant.

    `/healthz` and `/readyz` stay open: orchestrators probe them without credentials
    and they reveal nothing about tenants. A degraded shared tier keeps `/readyz` at 200
    (the sidecar serves from its local tiers) and shows in its `shared_tier`. Handlers
    are `async` on purpose: they run on the event loop, never concurrently with the
    gRPC servicer's synchronous parts.
    """
    if token is not None and not token.strip():
        raise ValueError("token must be None (no auth) or a non-blank string")
    if authenticator is None:
        authenticator = Authenticator(admin_token=token)
    app = FastAPI(title="kvsplice admin", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(KvspliceError, _kvsplice_error_response)
    # NOTE: a default, not `Annotated`: with postponed annotations FastAPI resolves
    # annotations in module globals, where this app's guard does not live.
    caller = Depends(tenant_guard(authenticator))
    admin_only = [Depends(admin_guard(authenticator))]

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(tenant: Tenant = caller) -> dict[str, Any]:
        return app.openapi()

    @app.get("/healthz", response_model=StatusOut, response_model_exclude_none=True)
    async def healthz() -> StatusOut:
        return StatusOut(status="ok")

    @app.get("/readyz", response_model=StatusOut, response_model_exclude_none=True)
    async def readyz(response: Response) -> StatusOut:
        shared = shared_status()
        if source.is_ready():
            return StatusOut(status="ready", shared_tier=shared)
        response.status_code = 503
        return StatusOut(status="not ready", shared_tier=shared)

    @app.get("/metrics", dependencies=admin_only)
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(content=body, media_type=content_type)

    @app.get("/v1/stats", response_model=StatsOut)
    async def stats(namespace: str | None = None, tenant: Tenant = caller) -> dict[str, Any]:
        checked = None if namespace is None else _checked_namespace(namespace)
        if checked is not None:
            authenticator.authorize(tenant, checked)
        rows = source.namespace_stats(checked).items()
        return {"namespaces": [stats_row(ns, s) for ns, s in rows if tenant.may_use(ns)]}

    @app.get("/v1/segments", response_model=SegmentPageOut)
    async def segments(
        namespace: str,
        offset: Annotated[int, Query(ge=0, le=MAX_PAGE_OFFSET)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE_LIMIT)] = DEFAULT_PAGE_LIMIT,
        tenant: Tenant = caller,
    ) -> SegmentPageOut:
        authenticator.authorize(tenant, _checked_namespace(namespace))
        page = source.list_segments(namespace, offset, limit)
        if len(page) > limit:
            raise RuntimeError(f"AdminSource.list_segments returned {len(page)} > {limit} rows")
        next_offset = offset + len(page) if len(page) == limit else None
        return SegmentPageOut(
            namespace=namespace, offset=offset, limit=limit, next_offset=next_offset, segments=page
        )

    @app.delete("/v1/segments/{segment_id}", response_model=DeletedOut)
    async def delete_segment(
        segment_id: str, namespace: str, tenant: Tenant = caller
    ) -> DeletedOut:
        authenticator.authorize(tenant, _checked_namespace(namespace), write=True)
        deleted = source.delete_segment(namespace, segment_id)
        return DeletedOut(namespace=namespace, segment_id=segment_id, deleted=deleted)

    @app.delete("/v1/namespaces/{namespace}", response_model=FlushOut)
    async def flush_namespace(namespace: str, tenant: Tenant = caller) -> FlushOut:
        authenticator.authorize(tenant, _checked_namespace(namespace), write=True)
        result = source.flush_namespace(namespace)
        return FlushOut(
            namespace=result.namespace, num_segments=result.num_segments,
            freed_bytes=result.freed_bytes, num_blobs=result.num_blobs,
        )  # fmt: skip

    add_dashboard(app, source, admin_only, version or package_version())

    return app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own SIGINT/SIGTERM handlers: the process owner decides when to stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    # Binding here (not in uvicorn) turns "address in use" into an OSError for the
    # caller; uvicorn would call sys.exit() inside the event loop shared with gRPC.
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return socket.create_server(address, family=family)


class AdminServer:
    """A running admin API; `await stop()` shuts it down gracefully (idempotent)."""

    def __init__(self, host: str, port: int, server: uvicorn.Server, task: asyncio.Task[None]):
        self.host = host
        self.port = port
        self._server = server
        self._task = task

    @property
    def running(self) -> bool:
        return not self._task.done()

    async def stop(self) -> None:
        """Stop accepting, let open requests finish (bounded), and re-raise a crash if any."""
        self._server.should_exit = True
        await self._task


def _tls_options(tls: TlsConfig | None) -> dict[str, Any]:
    if tls is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": tls.cert_path, "ssl_keyfile": tls.key_path}
    if tls.client_ca_path:
        options.update(ssl_ca_certs=tls.client_ca_path, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


async def run_admin(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8081, *, tls: TlsConfig | None = None
) -> AdminServer:
    """Start `app` on the running event loop and return once it accepts connections.

    `port=0` picks a free port (see `AdminServer.port`); `tls` serves HTTPS (mTLS when it
    names a client CA). Raises `OSError` if the address cannot be bound.
    """
    sock = _bind(host, port)
    config = uvicorn.Config(
        app,
        log_config=None,  # leave the host process's logging setup alone
        access_log=False,  # a scrape every few seconds would drown the log
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **_tls_options(tls),
    )
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="kvsplice-admin")
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # re-raises the startup failure
            raise RuntimeError("admin server exited before it started")
        await asyncio.sleep(0.005)
    bound_port = sock.getsockname()[1]
    scheme = "http" if tls is None else "https"
    logger.info("admin API listening on %s://%s:%d", scheme, host, bound_port)
    return AdminServer(host, bound_port, server, task)
