"""Fake servers for the store-client tests (no torch needed); segments are `helpers.store`'s."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc

from kvsplice.proto import store_pb2 as pb

SERVICE = "kvsplice.v1.SegmentStore"


def closed_port_target() -> str:
    """A loopback address nothing listens on (connections are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"


Behavior = Callable[..., object]


@contextmanager
def fake_store(**behaviors: tuple[str, Behavior]) -> Iterator[str]:
    """A sync gRPC server answering SegmentStore methods with test behaviors.

    Each keyword is a method name mapped to (kind, behavior), kind being
    "unary" or "server_stream"; message types are the contract's own.
    """
    handlers = {name: _handler(name, kind, fn) for name, (kind, fn) in behaviors.items()}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
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
