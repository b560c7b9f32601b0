"""`make_*` factories and fake servers for the store-client tests (no torch needed)."""

from __future__ import annotations

import random
import socket
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import replace

import grpc
import xxhash

from kvsplice.common.keys import content_key, context_key, root_key
from kvsplice.common.segment import SegmentMeta
from kvsplice.proto import store_pb2 as pb

FINGERPRINT = "kvfp1-" + "0" * 32
OTHER_FINGERPRINT = "kvfp1-" + "1" * 32
NAMESPACE = "tenant-a"
SERVICE = "kvsplice.v1.SegmentStore"


def make_payload(nbytes: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def make_meta(
    token_ids: Sequence[int],
    payload: bytes,
    *,
    parent_key: bytes | None = None,
    start_position: int = 0,
    namespace: str = NAMESPACE,
    **fields: object,
) -> SegmentMeta:
    """A segment after `parent_key` (the root by default) whose size and checksum fit `payload`."""
    parent = root_key(FINGERPRINT) if parent_key is None else parent_key
    tokens = tuple(token_ids)
    meta = SegmentMeta(
        namespace=namespace,
        model_fingerprint=FINGERPRINT,
        context_key=context_key(parent, tokens),
        parent_key=parent,
        content_key=content_key(tokens),
        token_ids=tokens,
        start_position=start_position,
        layer_start=0,
        layer_end=30,
        payload_nbytes=len(payload),
        checksum=xxhash.xxh3_64_intdigest(payload),
    )
    return replace(meta, **fields) if fields else meta


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
