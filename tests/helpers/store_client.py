"""Fake servers for the store-client tests (no torch needed); segments are `helpers.store`'s."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc

from kvsplice.proto import store_pb2 as pb

SERVICE = "kvsplice.v1.SegmentStore"


@contextmanager
def refusing_target(shareable: bool = False) -> Iterator[str]:
    """A loopback address that refuses connections while the block runs.

    NOTE: the port stays bound (never listening) until the block ends. A port bound then
    closed is handed to the next `bind(0)`: a server of a later test could get it while a
    client of this one still retries it. `shareable` (SO_REUSEPORT) lets a gRPC server of
    this block listen on it later (gRPC sets SO_REUSEPORT itself).
    """
    with socket.socket() as sock:
        if shareable:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


Behavior = Callable[..., object]


@contextmanager
def fake_store(address: str = "127.0.0.1:0", **behaviors: tuple[str, Behavior]) -> Iterator[str]:
    """A sync gRPC server at `address` answering SegmentStore methods with test behaviors.

    Each other keyword is a method name mapped to (kind, behavior), kind being
    "unary" or "server_stream"; message types are the contract's own. The server
    listens before the block starts.
    """
    handlers = {name: _handler(name, kind, fn) for name, (kind, fn) in behaviors.items()}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port(address)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def _handler(name: str, kind: str, behavior: Behavior) -> grpc.RpcMethodHandler:
    method = pb.DESCRIPTOR.services_by_name["SegmentStore"].methods_by_name[name]
    request_type = getattr(pb, method.input_type.name)
    response_type = getattr(pb, method.output_type.name)
    kwargs = {
        "request_deserializer": request_type.FromString,
        "response_serializer": response_type.SerializeToString,
    }
    if kind == "server_stream":
        return grpc.unary_stream_rpc_method_handler(behavior, **kwargs)
    if kind == "client_stream":
        return grpc.stream_unary_rpc_method_handler(behavior, **kwargs)
    return grpc.unary_unary_rpc_method_handler(behavior, **kwargs)
