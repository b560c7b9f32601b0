"""Counts the RPCs a store client starts, by method: a gRPC client interceptor on its channel.

Owns the counting only: every attempt through the channel (retries included), whichever
client code starts it, so a round trip added anywhere shows up. Never changes a call.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc


class RpcCounter(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """RPCs started through the channels it intercepts, by short method name ("GetSegment")."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._method_to_count: Counter[str] = Counter()

    def snapshot(self) -> dict[str, int]:
        """The counts so far (a copy): subtract two snapshots to count what happened between."""
        with self._lock:
            return dict(self._method_to_count)

    @property
    def num_rpcs(self) -> int:
        with self._lock:
            return sum(self._method_to_count.values())

    def _count(self, details: grpc.ClientCallDetails) -> None:
        method = details.method
        name = (method.decode() if isinstance(method, bytes) else method).rsplit("/", 1)[-1]
        with self._lock:
            self._method_to_count[name] += 1

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        self._count(details)
        return continuation(details, request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        self._count(details)
        return continuation(details, request)

    def intercept_stream_unary(
        self,
        continuation: Callable[..., Any],
        details: grpc.ClientCallDetails,
        requests: Iterator[Any],
    ) -> Any:
        self._count(details)
        return continuation(details, requests)

    def intercept_stream_stream(
        self,
        continuation: Callable[..., Any],
        details: grpc.ClientCallDetails,
        requests: Iterator[Any],
    ) -> Any:
        self._count(details)
        return continuation(details, requests)


def rpcs_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """`after - before` by method, methods with no new RPC left out."""
    return {m: n - before.get(m, 0) for m, n in sorted(after.items()) if n > before.get(m, 0)}
