"""Measure unary vs streamed payload transfer over loopback gRPC in Python.

Real contract message types on a throwaway grpc.aio server (protobuf copies included);
prints median ms per direction. Usage: bench_transport.py [--sizes-mib 1 8 32] [--chunk-mib 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc

from kvsplice.proto import store_pb2 as pb

SLACK_NBYTES = 1 << 20
SERVICE = "bench.Transport"
# method -> (cardinality, request type, response type): the server and the client both build
# their side from this one table.
METHODS: dict[str, tuple[str, Any, Any]] = {
    "UnaryPut": ("unary_unary", pb.PutSegmentRequest, pb.PutSegmentResponse),
    "StreamPut": ("stream_unary", pb.PutSegmentRequest, pb.PutSegmentResponse),
    "UnaryGet": ("unary_unary", pb.GetSegmentRequest, pb.GetSegmentResponse),
    "StreamGet": ("unary_stream", pb.GetSegmentRequest, pb.GetSegmentResponse),
}


def _handlers(payloads: dict[int, bytes], chunk_nbytes: int) -> grpc.GenericRpcHandler:
    async def unary_put(request: pb.PutSegmentRequest, context: object) -> pb.PutSegmentResponse:
        return pb.PutSegmentResponse(context_key=len(request.chunk).to_bytes(8, "little"))

    async def stream_put(
        requests: AsyncIterator[pb.PutSegmentRequest], context: object
    ) -> pb.PutSegmentResponse:
        parts = [r.chunk async for r in requests]
        return pb.PutSegmentResponse(context_key=len(b"".join(parts)).to_bytes(8, "little"))

    async def unary_get(request: pb.GetSegmentRequest, context: object) -> pb.GetSegmentResponse:
        return pb.GetSegmentResponse(chunk=payloads[len(request.context_key)])

    async def stream_get(
        request: pb.GetSegmentRequest, context: object
    ) -> AsyncIterator[pb.GetSegmentResponse]:
        data = memoryview(payloads[len(request.context_key)])
        for start in range(0, len(data), chunk_nbytes):
            yield pb.GetSegmentResponse(chunk=bytes(data[start : start + chunk_nbytes]))

    impls = {"UnaryPut": unary_put, "StreamPut": stream_put, "UnaryGet": unary_get,
             "StreamGet": stream_get}  # fmt: skip
    handlers = {
        name: getattr(grpc, f"{kind}_rpc_method_handler")(
            impls[name],
            request_deserializer=request.FromString,
            response_serializer=response.SerializeToString,
        )
        for name, (kind, request, response) in METHODS.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _callables(channel: grpc.Channel) -> dict[str, Any]:
    """A client callable per `METHODS` entry, by method name."""
    return {
        name: getattr(channel, kind)(
            f"/{SERVICE}/{name}", request.SerializeToString, response.FromString
        )
        for name, (kind, request, response) in METHODS.items()
    }


def _serve(
    options: list[tuple[str, int]],
    handler: grpc.GenericRpcHandler,
    ready: threading.Event,
    port: list[int],
    stop: threading.Event,
) -> None:
    async def main() -> None:
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((handler,))
        port.append(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(None)

    asyncio.run(main())


def _chunks(payload: bytes, chunk_nbytes: int) -> Iterator[pb.PutSegmentRequest]:
    view = memoryview(payload)
    yield pb.PutSegmentRequest(header=pb.SegmentHeader(payload_nbytes=len(payload)))
    for start in range(0, len(payload), chunk_nbytes):
        yield pb.PutSegmentRequest(chunk=bytes(view[start : start + chunk_nbytes]))


def _time_ms(fn: object, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--chunk-mib", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    chunk_nbytes = args.chunk_mib << 20
    max_unary = (max(args.sizes_mib) << 20) + SLACK_NBYTES
    options = [
        ("grpc.max_receive_message_length", max_unary),
        ("grpc.max_send_message_length", max_unary),
    ]
    # The size of the key selects the payload: a 1-byte key means 1 MiB, etc.
    payloads = {mib: bytes(mib << 20) for mib in args.sizes_mib}
    ready, stop, port = threading.Event(), threading.Event(), []
    thread = threading.Thread(
        target=_serve, args=(options, _handlers(payloads, chunk_nbytes), ready, port, stop)
    )
    thread.start()
    ready.wait()
    channel = grpc.insecure_channel(f"127.0.0.1:{port[0]}", options=options)
    calls = _callables(channel)
    unary_put, stream_put = calls["UnaryPut"], calls["StreamPut"]
    unary_get, stream_get = calls["UnaryGet"], calls["StreamGet"]
    print(f"chunk {args.chunk_mib} MiB, median of {args.reps}")
    print(
        f"{'MiB':>4} {'unary put':>10} {'stream put':>11} {'unary get':>10} {'stream get':>11}  (ms)"
    )
    try:
        for mib in args.sizes_mib:
            payload = payloads[mib]
            key = pb.GetSegmentRequest(context_key=bytes(mib))
            results = [
                _time_ms(lambda p=payload: unary_put(pb.PutSegmentRequest(chunk=p)), args.reps),
                _time_ms(lambda p=payload: stream_put(_chunks(p, chunk_nbytes)), args.reps),
                _time_ms(lambda k=key: unary_get(k).chunk, args.reps),
                _time_ms(lambda k=key: b"".join(r.chunk for r in stream_get(k)), args.reps),
            ]
            mbps = [f"{(mib * 1.048576) / (ms / 1e3):.0f}" for ms in results]
            print(
                f"{mib:>4} "
                + " ".join(f"{ms:>10.1f}" for ms in results)
                + "   MB/s: "
                + "/".join(mbps)
            )
    finally:
        channel.close()
        stop.set()
        thread.join()


if __name__ == "__main__":
    main()
