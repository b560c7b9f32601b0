"""The asyncio store client: the same calls and miss semantics as `StoreClient`.

Construct it inside the event loop that uses it (grpc.aio channels bind to one loop).
No torch here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import TypeVar

import grpc

from kvsplice.client import store_wire as wire
from kvsplice.client.same_host import SameHostPath
from kvsplice.client.store_channel import open_aio_channel
from kvsplice.client.store_client import bearer_metadata, checked_namespace
from kvsplice.client.store_config import ClientTls, StoreClientConfig
from kvsplice.client.store_faults import (
    MIN_ATTEMPT_TIMEOUT_S,
    DegradedWarning,
    async_retrying,
    error_from_rpc,
)
from kvsplice.client.store_types import (
    AnchorEntry,
    ClientCounters,
    PrefixLookup,
    SimilarCandidate,
    StoreStats,
)
from kvsplice.common.buffers import BufferPool
from kvsplice.common.errors import CorruptPayload, InvalidRequest, NotFound, StoreUnavailable
from kvsplice.common.segment import SegmentMeta
from kvsplice.proto import store_pb2_grpc

T = TypeVar("T")
_UNASKED = object()  # `_same_host` before the sidecar was asked where its data plane is
Attempt = Callable[[float], Awaitable[T]]

logger = logging.getLogger(__name__)


class AsyncStoreClient:
    """Talks to one store over one aio channel, scoped to one namespace."""

    def __init__(
        self,
        target: str,
        namespace: str,
        token: str | None = None,
        config: StoreClientConfig | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        self.namespace = checked_namespace(namespace)
        self.config = config or StoreClientConfig()
        self.counters = ClientCounters()
        self._channel = open_aio_channel(target, self.config.channel_options(), tls)
        self._stub = store_pb2_grpc.SegmentStoreStub(self._channel)
        self._put_segment = self._channel.stream_unary(*wire.PUT_SEGMENT, _registered_method=True)
        self._get_segment = self._channel.unary_stream(*wire.GET_SEGMENT, _registered_method=True)
        self._metadata = bearer_metadata(token)
        self._warning = DegradedWarning(target, self.config.warn_interval_s)
        self._buffers = BufferPool(self.config.receive_pool_bytes)
        self._same_host: SameHostPath | object | None = (
            _UNASKED if self.config.same_host_reads else None
        )

    async def put_segment(self, meta: SegmentMeta, payload: bytes) -> bool:
        """Store `payload` under `meta`; True once the store holds a segment under its key
        (this one, or an earlier one with other bytes: keys are immutable, the first
        stays); False if the store could not be reached in time."""
        if meta.namespace != self.namespace:
            raise InvalidRequest(
                f"segment namespace {meta.namespace!r} != client's {self.namespace!r}"
            )
        frames = wire.put_frames(
            wire.with_payload_digest(meta, payload), payload, self.config.chunk_nbytes
        )

        async def send(timeout_s: float) -> bool:
            try:
                await self._put_segment(frames, timeout=timeout_s, metadata=self._metadata)
            except grpc.RpcError as error:
                if error.code() is not grpc.StatusCode.ALREADY_EXISTS:  # type: ignore[attr-defined]
                    raise
                # NOTE: the key is held: its segment is these tokens after this same left
                # context (an earlier put, its bytes kept), so a key chain through it holds.
                logger.debug("segment %s already stored; the first copy stays", meta.segment_id)
            return True

        return await self._once("put_segment", send, self.config.put_timeout_s, False)

    async def get_segment(
        self, segment_id_or_context_key: str | bytes, *, model_fingerprint: str | None = None
    ) -> tuple[SegmentMeta, bytes] | None:
        """The segment's meta and verified payload, or None (absent, corrupt or unreachable).

        Read in place on the sidecar's host like `StoreClient.get_segment` (the read is a
        map lookup plus one checksum pass, so it runs on the loop); else over gRPC.
        """
        key = wire.to_context_key(segment_id_or_context_key)
        try:
            local = await self._same_host_path()
            if local is not None:
                try:
                    found = local.get_segment(key, model_fingerprint)
                    self.counters.num_same_host_reads += 1
                    return found
                except StoreUnavailable as error:  # this read goes over gRPC; ask again next
                    self._warning.warn("get_segment (same host)", str(error))
                    local.close()
                    self._same_host = _UNASKED
            return await self._get_over_grpc(key, model_fingerprint)
        except CorruptPayload as error:
            self.counters.num_corrupt_payloads += 1
            self._warning.warn("get_segment", str(error))
            return None

    async def _get_over_grpc(
        self, key: bytes, model_fingerprint: str | None
    ) -> tuple[SegmentMeta, bytes] | None:
        request = wire.get_request(self.namespace, key, model_fingerprint)

        async def read(timeout_s: float) -> tuple[SegmentMeta, bytes]:
            assembler = wire.SegmentAssembler(self._buffers)
            async for response in self._get_segment(
                request, timeout=timeout_s, metadata=self._metadata
            ):
                assembler.feed(response)
            return assembler.finish()

        try:
            return await self._idempotent("get_segment", read, self.config.get_timeout_s, None)
        except NotFound:
            return None

    async def _same_host_path(self) -> SameHostPath | None:
        """As `StoreClient._same_host_path`: ask once, None means gRPC only."""
        if isinstance(self._same_host, SameHostPath) and not self._same_host.usable:
            self._same_host = _UNASKED
        if self._same_host is _UNASKED:
            request = wire.data_plane_request(self.namespace)
            try:
                response = await self._stub.DescribeDataPlane(
                    request, timeout=self.config.lookup_timeout_s, metadata=self._metadata
                )
            except grpc.RpcError as rpc_error:
                if isinstance(error_from_rpc(rpc_error), StoreUnavailable):
                    return None
                self._same_host = None
                return None
            self._same_host = SameHostPath.open(wire.data_plane_result(response), self.namespace)
        return self._same_host if isinstance(self._same_host, SameHostPath) else None

    async def lookup_prefix(self, model_fingerprint: str, token_ids: Sequence[int]) -> PrefixLookup:
        request = wire.lookup_request(self.namespace, model_fingerprint, token_ids)
        call = self._unary(self._stub.LookupPrefix, request, wire.lookup_result)
        return await self._idempotent(
            "lookup_prefix", call, self.config.lookup_timeout_s, PrefixLookup.MISS
        )

    async def find_similar(
        self,
        model_fingerprint: str,
        token_ids: Sequence[int],
        *,
        text: str = "",
        left_context_ids: Sequence[int] = (),
        parent_key: bytes | None = None,
        limit: int = 0,
    ) -> list[SimilarCandidate]:
        request = wire.similar_request(
            self.namespace, model_fingerprint, token_ids, text, left_context_ids, parent_key, limit
        )
        call = self._unary(self._stub.FindSimilar, request, wire.similar_result)
        return await self._idempotent("find_similar", call, self.config.lookup_timeout_s, [])

    async def put_anchor(
        self,
        model_fingerprint: str,
        placeholder_id: str,
        anchor_id: str,
        base_payload: bytes,
        agent_payloads: Mapping[str, bytes],
        num_tokens: int,
    ) -> list[str] | None:
        requests = wire.put_anchor_requests(
            self.namespace,
            model_fingerprint,
            placeholder_id,
            anchor_id,
            base_payload,
            agent_payloads,
            num_tokens,
            self.config.chunk_nbytes,
        )

        async def send(timeout_s: float) -> list[str]:
            response = await self._stub.PutAnchor(
                requests, timeout=timeout_s, metadata=self._metadata
            )
            return list(response.evicted_anchor_ids)

        return await self._once("put_anchor", send, self.config.put_timeout_s, None)

    async def get_anchors(
        self,
        model_fingerprint: str,
        placeholder_id: str,
        *,
        include_payloads: bool = True,
        anchor_ids: Sequence[str] = (),
        agent_id: str | None = None,
    ) -> list[AnchorEntry]:
        """The pool's anchors (only `anchor_ids` if given; only `agent_id`'s offsets if given).

        With payloads, ask for one anchor at a time: the store refuses answers
        holding more than one anchor's worth (`max_anchor_nbytes`) of payloads.
        """
        request = wire.get_anchors_request(
            self.namespace,
            model_fingerprint,
            placeholder_id,
            include_payloads,
            anchor_ids,
            agent_id,
        )

        async def read(timeout_s: float) -> list[AnchorEntry]:
            assembler = wire.AnchorsAssembler()
            async for response in self._stub.GetAnchors(
                request, timeout=timeout_s, metadata=self._metadata
            ):
                assembler.feed(response)
            return assembler.finish()

        try:
            return await self._idempotent("get_anchors", read, self.config.get_timeout_s, [])
        except CorruptPayload as error:
            self.counters.num_corrupt_payloads += 1
            self._warning.warn("get_anchors", str(error))
            return []

    async def touch_anchors(
        self, model_fingerprint: str, placeholder_id: str, anchor_ids: Sequence[str]
    ) -> int:
        request = wire.touch_anchors_request(
            self.namespace, model_fingerprint, placeholder_id, anchor_ids
        )
        call = self._unary(self._stub.TouchAnchors, request, lambda r: int(r.num_touched))
        return await self._once("touch_anchors", call, self.config.lookup_timeout_s, 0)

    async def delete(self, segment_id_or_context_key: str | bytes) -> bool:
        key = wire.to_context_key(segment_id_or_context_key)
        request = wire.delete_request(self.namespace, key)
        call = self._unary(self._stub.Delete, request, lambda r: bool(r.deleted))
        return await self._once("delete", call, self.config.lookup_timeout_s, False)

    async def stats(self) -> StoreStats | None:
        request = wire.stats_request(self.namespace)
        call = self._unary(self._stub.Stats, request, wire.stats_result)
        return await self._idempotent("stats", call, self.config.lookup_timeout_s, None)

    async def close(self) -> None:
        if isinstance(self._same_host, SameHostPath):
            self._same_host.close()
        self._same_host = None
        await self._channel.close()

    async def __aenter__(self) -> AsyncStoreClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _unary(
        self, method: Callable[..., Awaitable[object]], request: object, decode: Callable[..., T]
    ) -> Attempt[T]:
        async def call(timeout_s: float) -> T:
            return decode(await method(request, timeout=timeout_s, metadata=self._metadata))

        return call

    async def _idempotent(self, operation: str, call: Attempt[T], timeout_s: float, miss: T) -> T:
        """`call` retried on transient failures within one deadline; `miss` if it never succeeds."""
        deadline_s = time.monotonic() + timeout_s
        try:
            async for attempt in async_retrying(self.config, timeout_s):
                with attempt:
                    return await call(max(deadline_s - time.monotonic(), MIN_ATTEMPT_TIMEOUT_S))
        except grpc.RpcError as rpc_error:
            return self._settle(operation, rpc_error, miss)
        raise AssertionError("tenacity returned without an attempt")  # pragma: no cover

    async def _once(self, operation: str, call: Attempt[T], timeout_s: float, miss: T) -> T:
        try:
            return await call(timeout_s)
        except grpc.RpcError as rpc_error:
            return self._settle(operation, rpc_error, miss)

    def _settle(self, operation: str, rpc_error: grpc.RpcError, miss: T) -> T:
        """`miss` (with one rate-limited warning) if the store was unreachable; else raise."""
        error = error_from_rpc(rpc_error)
        if not isinstance(error, StoreUnavailable):
            raise error from rpc_error
        self.counters.num_degraded_calls += 1
        self._warning.warn(operation, str(error))
        return miss
