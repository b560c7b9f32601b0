"""The server's two grpc.aio interceptors: tenant authentication and fault → status mapping.

`FaultInterceptor` is the one place a `KvspliceError` becomes a status code (its
`status_name`) and is logged (callers' faults rate-limited: hostile input cannot fill
a disk); it also times every RPC and turns undecodable messages into INVALID_ARGUMENT.
Servicers only raise. Which namespaces a tenant may use is the servicer's check.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from kvsplice.common.errors import InvalidRequest, KvspliceError
from kvsplice.common.log_limits import RateLimitedLog
from kvsplice.server.metrics import StoreMetrics
from kvsplice.server.tenants import Authenticator

logger = logging.getLogger(__name__)

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]
# Health and reflection stay open so probes (grpc_health_probe, grpcurl) need no token.
PUBLIC_SERVICE_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
# Faults of the caller's making: logged at most once per (method, code) and interval.
CALLER_FAULTS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
LOG_INTERVAL_S = 10.0


class UndecodableMessage(InvalidRequest):
    """INVALID_ARGUMENT for bytes that are no message of the method's type."""


class Undecodable:
    """What a request deserializer returns instead of raising (grpc would log a traceback)."""

    __slots__ = ("nbytes", "reason")

    def __init__(self, nbytes: int, reason: str) -> None:
        self.nbytes = nbytes
        self.reason = reason


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(message: bytes) -> Any:
        try:
            return deserializer(message)
        except Exception as error:  # DecodeError, or anything a hostile message provokes
            return Undecodable(len(message), type(error).__name__)

    return deserialize


def _decoded(request: Any) -> Any:
    if isinstance(request, Undecodable):
        raise UndecodableMessage(f"undecodable message ({request.nbytes} bytes, {request.reason})")
    return request


async def _decoded_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _decoded(request)


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
        "request_deserializer": _tolerant(handler.request_deserializer),
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
    assert handler.stream_stream is not None  # a handler has one behavior, the others None
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **kwargs)


def _status_code(error: KvspliceError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.status_name, grpc.StatusCode.INTERNAL)


class _Call:
    """One RPC in flight: converts its fault to a status exactly once and times it."""

    def __init__(self, method: str, metrics: StoreMetrics, log: RateLimitedLog) -> None:
        self.method = method
        self.metrics = metrics
        self.log = log
        self.started_s = time.perf_counter()
        self.code = grpc.StatusCode.OK

    async def fail(self, context: aio.ServicerContext, error: Exception) -> None:
        """Log `error` once and end the call with its status (raises AbortError)."""
        if isinstance(error, KvspliceError):
            self.code = _status_code(error)
            self._log_fault(context, error)
            await context.abort(self.code, str(error))
        self.code = grpc.StatusCode.INTERNAL
        logger.error("%s failed unexpectedly", self.method, exc_info=error)
        await context.abort(self.code, f"internal error in {self.method}")

    def _log_fault(self, context: aio.ServicerContext, error: KvspliceError) -> None:
        if self.code is grpc.StatusCode.NOT_FOUND:  # an ordinary miss
            logger.debug("%s -> NOT_FOUND: %s", self.method, error)
            return
        if self.code not in CALLER_FAULTS:
            logger.info("%s -> %s: %s", self.method, self.code.name, error)
            return
        undecodable = isinstance(error, UndecodableMessage)
        self.log.log(
            "undecodable" if undecodable else (self.method, self.code.name),
            logging.WARNING if undecodable else logging.INFO,
            "%s -> %s from %s: %s",
            self.method,
            self.code.name,
            context.peer(),
            error,
        )

    def finish(self, cancelled: bool = False) -> None:
        code = grpc.StatusCode.CANCELLED if cancelled else self.code
        if self.method in self.metrics.rpc_methods:
            self.metrics.observe_rpc(self.method, time.perf_counter() - self.started_s, code.name)


class FaultInterceptor(aio.ServerInterceptor):
    """Maps `KvspliceError.status_name` to the call's status; anything else is INTERNAL."""

    def __init__(self, metrics: StoreMetrics, log_interval_s: float = LOG_INTERVAL_S) -> None:
        self._metrics = metrics
        self._log = RateLimitedLog(logger, log_interval_s)

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
            call = _Call(method, self._metrics, self._log)
            cancelled = False
            try:
                return await behavior(_checked(request), context)
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
            call = _Call(method, self._metrics, self._log)
            cancelled = False
            try:
                async for response in behavior(_checked(request), context):
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


def _checked(request: Any) -> Any:
    """A unary request, or a request stream whose undecodable messages raise when read."""
    if hasattr(request, "__aiter__") and not isinstance(request, Undecodable):
        return _decoded_stream(request)
    return _decoded(request)


def bearer_of(metadata: Any) -> str | None:
    """The `authorization` value of a call's metadata (None when absent)."""
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


class TenantAuthInterceptor(aio.ServerInterceptor):
    """Rejects (UNAUTHENTICATED) calls whose bearer token names no tenant.

    Health and reflection stay open. Namespaces are checked by the servicer, which
    sees the request (`Authenticator.authorize`).
    """

    def __init__(self, authenticator: Authenticator) -> None:
        self._authenticator = authenticator

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method.startswith(PUBLIC_SERVICE_PREFIXES):
            return await continuation(handler_call_details)
        try:
            self._authenticator.authenticate(bearer_of(handler_call_details.invocation_metadata))
            return await continuation(handler_call_details)
        except KvspliceError as error:
            rejection = error
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        # A coroutine that raises serves every kind of RPC (no response is ever written).
        return _wrap_handler(
            handler, lambda _: _rejecting(rejection), lambda _: _rejecting(rejection)
        )


def _rejecting(error: KvspliceError) -> Callable[..., Awaitable[Any]]:
    async def reject(request: Any, context: aio.ServicerContext) -> Any:
        raise error

    return reject
