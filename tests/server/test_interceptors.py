"""The interceptors on a throwaway grpc.aio server: every fault class maps to its status
code exactly once (one log line), anything unexpected is INTERNAL, tokens are checked."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from grpc import aio

from kvsplice.common import errors
from kvsplice.server.interceptors import FaultInterceptor, TenantAuthInterceptor
from kvsplice.server.metrics import StoreMetrics
from kvsplice.server.tenants import Authenticator

FAULTS = [
    errors.InvalidRequest,
    errors.FingerprintMismatch,
    errors.LayoutMismatch,
    errors.CorruptPayload,
    errors.ResourceExhausted,
    errors.Unauthenticated,
    errors.NotFound,
    errors.UnsupportedRope,
]
INTERCEPTOR_LOGGER = "kvsplice.server.interceptors"


def make_handler(fault: Callable[[], BaseException | None]) -> grpc.GenericRpcHandler:
    """`Unary` raises `fault()` (or echoes); `Stream` yields once, then raises it."""

    async def unary(request: bytes, context: aio.ServicerContext) -> bytes:
        error = fault()
        if error is not None:
            raise error
        return request

    async def stream(request: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
        yield request
        error = fault()
        if error is not None:
            raise error

    return grpc.method_handlers_generic_handler(
        "test.Faults",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
        },
    )


async def start_server(
    fault: Callable[[], BaseException | None], token: str | None = None
) -> tuple[aio.Server, StoreMetrics, str]:
    metrics = StoreMetrics(["Unary", "Stream"])
    interceptors: list[aio.ServerInterceptor] = [FaultInterceptor(metrics)]
    if token is not None:
        interceptors.append(TenantAuthInterceptor(Authenticator(admin_token=token)))
    server = aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers((make_handler(fault),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, metrics, f"127.0.0.1:{port}"


async def call(
    target: str, method: str, metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.StatusCode:
    async with aio.insecure_channel(target) as channel:
        try:
            if method == "Unary":
                await channel.unary_unary("/test.Faults/Unary")(b"x", timeout=5, metadata=metadata)
            else:
                async for _ in channel.unary_stream("/test.Faults/Stream")(
                    b"x", timeout=5, metadata=metadata
                ):
                    pass
        except aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


async def rpc_count(metrics: StoreMetrics, sample: dict[str, str]) -> float | None:
    """The RPC's duration count once the handler has recorded it. The handler records it
    after the client already has its status, so a loaded machine can run the test's next
    line first (once, the server then stopped and the count never came): wait up to 5 s."""
    deadline = time.monotonic() + 5.0
    name = "kvsplice_rpc_duration_seconds_count"
    while (value := metrics.registry.get_sample_value(name, sample)) is None:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    return value


def interceptor_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == INTERCEPTOR_LOGGER]


@pytest.mark.parametrize("method", ["Unary", "Stream"])
@pytest.mark.parametrize("fault", FAULTS)
async def test_each_fault_maps_to_its_status_and_is_logged_once(
    fault: type[errors.KvspliceError], method: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=INTERCEPTOR_LOGGER)
    server, metrics, target = await start_server(lambda: fault("boom"))
    sample = {"method": method, "code": fault.status_name}
    try:
        code = await call(target, method)
        count = await rpc_count(metrics, sample)
    finally:
        await server.stop(None)
    assert code.name == fault.status_name
    assert len(interceptor_records(caplog)) == 1
    assert count == 1


async def test_unexpected_exceptions_are_internal_with_one_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, _, target = await start_server(lambda: KeyError("secret detail"))
    try:
        assert await call(target, "Unary") == grpc.StatusCode.INTERNAL
    finally:
        await server.stop(None)
    (record,) = interceptor_records(caplog)
    assert record.levelno == logging.ERROR and record.exc_info is not None


async def test_successful_calls_are_timed_as_ok() -> None:
    server, metrics, target = await start_server(lambda: None)
    try:
        assert await call(target, "Unary") == grpc.StatusCode.OK
        assert await call(target, "Stream") == grpc.StatusCode.OK
        counts = [
            await rpc_count(metrics, {"method": m, "code": "OK"}) for m in ("Unary", "Stream")
        ]
    finally:
        await server.stop(None)
    assert counts == [1, 1]


@pytest.mark.parametrize("method", ["Unary", "Stream"])
async def test_bearer_token_is_required_when_configured(method: str) -> None:
    server, _, target = await start_server(lambda: None, token="t0ken")
    try:
        assert await call(target, method) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            await call(target, method, (("authorization", "Bearer t0ke"),))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        assert (
            await call(target, method, (("authorization", "t0ken"),))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        assert (
            await call(target, method, (("authorization", "Bearer t0ken"),)) == grpc.StatusCode.OK
        )
    finally:
        await server.stop(None)


def test_an_empty_token_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="token"):
        Authenticator(admin_token="")
