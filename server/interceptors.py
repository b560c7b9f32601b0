"""The server's two grpc.aio interceptors: bearer-token auth and fault → status mapping.

`FaultInterceptor` is the one place a `KvspliceError` becomes a status code (its
`status_name`) and is logged; it also times every RPC. Servicers only raise.
"""

from __future__ import annotations

import hmac
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from kvsplice.common.errors import KvspliceError, Unauthenticated
from kvsplice.server.metrics import StoreMetrics

logger = logging.getLogger(__name__)

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]
# Health and reflection stay open so probes (grpc_health_probe, grpcurl) need no token.
PUBLIC_SERVICE_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def method_name(full_method: str) -> str:
    """'/kvsplice.v1.SegmentStore/GetSegment' -> 'GetSegment'."""
    return full_method.rsplit("/", 1)[-1]


def _wrap_handler(
    handler: grpc.RpcMethodHandler,
    wrap_coroutine: Callable[..., Any],
    wrap_generator: Callable[..., Any],
) -> grpc.RpcMethodHandler:
    """Rebuild `handler` with its behavior wrapped.

    A streaming behavior is either an async generator (our servicer) or a coroutine
    that calls `context.write` (grpc_health's Watch); each needs a wrapper of its kind.
    """
    kwargs = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }

    def wrap(behavior: Callable[..., Any]) -> Callable[..., Any]:
        return (
            wrap_generator(behavior)
            if inspect.isasyncgenfunction(behavior)
            else wrap_coroutine(behavior)
        )

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **kwargs)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **kwargs)


def _status_code(error: KvspliceError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.status_name, grpc.StatusCode.INTERNAL)


class _Call:
    """One RPC in flight: converts its fault to a status exactly once and times it."""

    def __init__(self, method: str, metrics: StoreMetrics) -> None:
        self.method = method
        self.metrics = metrics
        self.started_s = time.perf_counter()
        self.code = grpc.StatusCode.OK

    async def fail(self, context: aio.ServicerContext, error: Exception) -> None:
        """Log `error` once and end the call with its status (raises AbortError)."""
        if isinstance(error, KvspliceError):
            self.code = _status_code(error)
            # NOT_FOUND is an ordinary miss; anything else is worth a line at INFO.
            level = logging.DEBUG if self.code is grpc.StatusCode.NOT_FOUND else logging.INFO
            logger.log(level, "%s -> %s: %s", self.method, self.code.name, error)
            await context.abort(self.code, str(error))
        self.code = grpc.StatusCode.INTERNAL
        logger.error("%s failed unexpectedly", self.method, exc_info=error)
        await context.abort(self.code, f"internal error in {self.method}")

    def finish(self, cancelled: bool = False) -> None:
        code = grpc.StatusCode.CANCELLED if cancelled else self.code
        if self.method in self.metrics.rpc_methods:
            self.metrics.observe_rpc(self.method, time.perf_counter() - self.started_s, code.name)


class FaultInterceptor(aio.ServerInterceptor):
    """Maps `KvspliceError.status_name` to the call's status; anything else is INTERNAL."""

    def __init__(self, metrics: StoreMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = method_name(handler_call_details.method)
        return _wrap_handler(
            handler,
            lambda behavior: self._wrap_coroutine(method, behavior),
            lambda behavior: self._wrap_generator(method, behavior),
        )

    def _wrap_coroutine(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapped(request: Any, context: aio.ServicerContext) -> Any:
            call = _Call(method, self._metrics)
            cancelled = False
            try:
                return await behavior(request, context)
            except aio.AbortError:
                raise
            except Exception as error:
                await call.fail(context, error)
            except BaseException:  # asyncio.CancelledError: the client went away
                cancelled = True
                raise
            finally:
                call.finish(cancelled)

        return wrapped

    def _wrap_generator(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapped_generator(
            request: Any, context: aio.ServicerContext
        ) -> AsyncIterator[Any]:
            call = _Call(method, self._metrics)
            cancelled = False
            try:
                async for response in behavior(request, context):
                    yield response
            except aio.AbortError:
                raise
            except Exception as error:
                await call.fail(context, error)
            except BaseException:
                cancelled = True
                raise
            finally:
                call.finish(cancelled)

        return wrapped_generator


class BearerAuthInterceptor(aio.ServerInterceptor):
    """Rejects calls whose `authorization: Bearer <token>` metadata is missing or wrong."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth token must be non-empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method.startswith(PUBLIC_SERVICE_PREFIXES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        presented = str(metadata.get("authorization", "")).encode()
        # compare_digest runs in time independent of where the strings differ.
        if hmac.compare_digest(presented, self._expected):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        error = Unauthenticated("missing or wrong bearer token")
        # A coroutine that raises serves every kind of RPC (no response is ever written).
        return _wrap_handler(handler, lambda _: _rejecting(error), lambda _: _rejecting(error))


def _rejecting(error: KvspliceError) -> Callable[..., Awaitable[Any]]:
    async def reject(request: Any, context: aio.ServicerContext) -> Any:
        raise error

    return reject
