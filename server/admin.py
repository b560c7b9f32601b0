"""The admin HTTP API (health, readiness, metrics, per-namespace stats, segments, delete, flush).

Owns the FastAPI app, its bearer-token guard and an embedded uvicorn runner that
shares the gRPC server's event loop. It reads the store only through `AdminSource`;
choosing host, port and token (default 127.0.0.1, no token) is the entry point's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse

from kvsplice.common.errors import KvspliceError
from kvsplice.common.segment import validate_namespace
from kvsplice.server.admin_models import (
    AdminSource,
    DeletedOut,
    FlushOut,
    NamespaceStatsOut,
    SegmentPageOut,
    SharedTierOut,
    StatsOut,
    StatusOut,
)
from kvsplice.server.dashboard import add_dashboard
from kvsplice.server.metrics import StoreMetrics, package_version

logger = logging.getLogger(__name__)

DEFAULT_PAGE_LIMIT = 100
MAX_PAGE_LIMIT = 1000
MAX_PAGE_OFFSET = 1 << 31
GRACEFUL_SHUTDOWN_S = 5
# gRPC status name (KvspliceError.status_name) -> HTTP status; anything else is a 500.
HTTP_STATUS_OF = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "NOT_FOUND": 404,
    "FAILED_PRECONDITION": 409,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
}


def _token_guard(token: str | None) -> Callable[[str | None], None]:
    expected = token.encode() if token is not None else None

    def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
        if expected is None:
            return
        scheme, _, presented = (authorization or "").partition(" ")
        # compare_digest: the time taken must not reveal how much of the token matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            presented.strip().encode(), expected
        ):
            raise HTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    return require_token


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
    else:
        logger.info("admin %s refused: %s", request.url.path, exc)
    return JSONResponse({"detail": str(exc), "code": exc.status_name}, status_code=status)


def build_admin_app(
    source: AdminSource,
    metrics: StoreMetrics,
    *,
    token: str | None = None,
    version: str | None = None,
    shared_status: Callable[[], SharedTierOut | None] = lambda: None,
) -> FastAPI:
    """The admin app. With `token`, `/metrics` and `/v1/*` need `Authorization: Bearer <token>`.

    `/healthz` and `/readyz` stay open: orchestrators probe them without credentials
    and they reveal nothing about tenants. A degraded shared tier keeps `/readyz` at 200
    (the sidecar serves from its local tiers) and shows in its `shared_tier`. Handlers
    are `async` on purpose: they run on the event loop, never concurrently with the
    gRPC servicer's synchronous parts.
    """
    if token is not None and not token.strip():
        raise ValueError("token must be None (no auth) or a non-blank string")
    app = FastAPI(title="kvsplice admin", docs_url=None, redoc_url=None)
    app.add_exception_handler(KvspliceError, _kvsplice_error_response)
    guarded = [Depends(_token_guard(token))]

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

    @app.get("/metrics", dependencies=guarded)
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(content=body, media_type=content_type)

    @app.get("/v1/stats", dependencies=guarded, response_model=StatsOut)
    async def stats(namespace: str | None = None) -> StatsOut:
        checked = None if namespace is None else _checked_namespace(namespace)
        rows = source.namespace_stats(checked)
        return StatsOut(namespaces=[NamespaceStatsOut.of(row) for row in rows])

    @app.get("/v1/segments", dependencies=guarded, response_model=SegmentPageOut)
    async def segments(
        namespace: str,
        offset: Annotated[int, Query(ge=0, le=MAX_PAGE_OFFSET)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE_LIMIT)] = DEFAULT_PAGE_LIMIT,
    ) -> SegmentPageOut:
        page = source.list_segments(_checked_namespace(namespace), offset, limit)
        if len(page) > limit:
            raise RuntimeError(f"AdminSource.list_segments returned {len(page)} > {limit} rows")
        next_offset = offset + len(page) if len(page) == limit else None
        return SegmentPageOut(
            namespace=namespace, offset=offset, limit=limit, next_offset=next_offset, segments=page
        )

    @app.delete("/v1/segments/{segment_id}", dependencies=guarded, response_model=DeletedOut)
    async def delete_segment(segment_id: str, namespace: str) -> DeletedOut:
        deleted = source.delete_segment(_checked_namespace(namespace), segment_id)
        return DeletedOut(namespace=namespace, segment_id=segment_id, deleted=deleted)

    @app.delete("/v1/namespaces/{namespace}", dependencies=guarded, response_model=FlushOut)
    async def flush_namespace(namespace: str) -> FlushOut:
        result = source.flush_namespace(_checked_namespace(namespace))
        return FlushOut(
            namespace=result.namespace, num_segments=result.num_segments,
            freed_bytes=result.freed_bytes, num_blobs=result.num_blobs,
        )  # fmt: skip

    add_dashboard(app, source, guarded, version or package_version())

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


async def run_admin(app: FastAPI, host: str = "127.0.0.1", port: int = 8081) -> AdminServer:
    """Start `app` on the running event loop and return once it accepts connections.

    `port=0` picks a free port (see `AdminServer.port`). Raises `OSError` if the
    address cannot be bound.
    """
    sock = _bind(host, port)
    config = uvicorn.Config(
        app,
        log_config=None,  # leave the host process's logging setup alone
        access_log=False,  # a scrape every few seconds would drown the log
        lifespan="off",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
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
    logger.info("admin API listening on http://%s:%d", host, bound_port)
    return AdminServer(host, bound_port, server, task)
