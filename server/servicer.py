"""The grpc.aio servicer of `kvsplice.v1.SegmentStore`: decode, call the domain, encode.

Methods check the caller's tenant against the request's namespace first, then raise
domain errors (`interceptors.FaultInterceptor` maps them); a GetSegment miss ends with
NOT_FOUND, which clients read as a miss. Payload reads and writes run on worker threads
(the event loop keeps answering health checks). Records byte and lookup metrics.
`add_to_server` registers it with payload chunks kept out of protobuf objects.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import MethodDescriptor
from grpc import aio

from kvsplice.common import staging
from kvsplice.common.errors import NotFound, PermissionDenied, StreamStalled
from kvsplice.common.segment import SegmentMeta
from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc
from kvsplice.proto.stats_wire import stats_response
from kvsplice.server import convert
from kvsplice.server.anchor_service import AnchorService
from kvsplice.server.data_plane import DataPlane
from kvsplice.server.interceptors import bearer_of
from kvsplice.server.metrics import StoreMetrics
from kvsplice.server.request_checks import check_namespace
from kvsplice.server.segment_service import SegmentService, similar_hit_tokens
from kvsplice.server.session_service import checked_session
from kvsplice.server.tenants import Authenticator
from kvsplice.server.upload_budget import UploadBudget
from kvsplice.storage.tiered_store import StoredSegment

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Payloads this large are verified, written and read on a worker thread (the event loop
# keeps answering health checks); smaller ones inline: a thread hop costs ~0.1 ms.
OFFLOAD_NBYTES = 1 << 20
_SERVICE = pb.DESCRIPTOR.services_by_name["SegmentStore"]
SERVICE_NAME = _SERVICE.full_name
RPC_METHODS = tuple(m.name for m in _SERVICE.methods)
# By (client streaming, server streaming), as the generated registration picks them.
_HANDLER_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class SegmentStoreServicer(store_pb2_grpc.SegmentStoreServicer):
    def __init__(
        self,
        segments: SegmentService,
        anchors: AnchorService,
        metrics: StoreMetrics,
        chunk_nbytes: int,
        data_plane: DataPlane | None = None,
        authenticator: Authenticator | None = None,
        uploads: UploadBudget | None = None,
    ) -> None:
        self._segments = segments
        self._data_plane = data_plane
        self._anchors = anchors
        self._metrics = metrics
        self._chunk_nbytes = chunk_nbytes
        self._auth = authenticator or Authenticator()
        self._uploads = uploads or UploadBudget()
        self._staging_dir = "" if data_plane is None else data_plane.staging_dir

    def _allow(self, context: aio.ServicerContext, namespace: str, write: bool = False) -> str:
        """`namespace`, checked, if the caller's tenant may use it (PERMISSION_DENIED if not)."""
        tenant = self._auth.authenticate(bearer_of(context.invocation_metadata()))
        self._auth.authorize(tenant, check_namespace(namespace), write=write)
        return namespace

    async def PutSegment(
        self, request_iterator: AsyncIterator[convert.PutPart], context: aio.ServicerContext
    ) -> pb.PutSegmentResponse:
        with self._uploads.slot() as slot:

            def admit(meta: SegmentMeta) -> SegmentMeta:
                self._allow(context, meta.namespace, write=True)
                return slot.reserve(self._segments.check_header(meta))

            session_ids: list[str] = []
            meta, payload = await convert.receive_segment(
                request_iterator, admit, self._uploads.idle_timeout_s,
                on_header=lambda header: session_ids.append(checked_session(header.session_id)),
            )  # fmt: skip
            stored = await _offloaded(meta.payload_nbytes, self._segments.write, meta, payload)
        return self._stored(stored, session_ids[0] if session_ids else "")

    async def PutStagedSegment(
        self, request: pb.PutStagedSegmentRequest, context: aio.ServicerContext
    ) -> pb.PutSegmentResponse:
        """A put whose payload waits in a staging file (`common.staging`): one message,
        mapped and written in one hop to a worker thread (the event loop reads no stream)."""
        with self._uploads.slot() as slot:
            meta = convert.header_to_meta(request.header)
            self._allow(context, meta.namespace, write=True)
            meta = slot.reserve(self._segments.check_header(meta))
            session_id = checked_session(request.header.session_id)
            staged = request.staged
            stored = await asyncio.to_thread(self._write_staged, meta, staged.name, staged.offset)
        return self._stored(stored, session_id)

    def _write_staged(self, meta: SegmentMeta, name: str, offset: int) -> SegmentMeta:
        payload = staging.map_staged(self._staging_dir, name, offset, meta.payload_nbytes)
        return self._segments.write(meta, payload)

    def _stored(self, stored: SegmentMeta, session_id: str) -> pb.PutSegmentResponse:
        """Index, hold and count a written segment; its put's response."""
        self._segments.index(stored)
        if session_id:
            self._segments.sessions.hold(stored.namespace, session_id, [stored.context_key])
        self._metrics.add_bytes("in", stored.payload_nbytes)
        self._metrics.observe_segment_size(stored.payload_nbytes)
        return pb.PutSegmentResponse(context_key=stored.context_key)

    async def get_segment_frames(
        self, request: pb.GetSegmentRequest, context: aio.ServicerContext
    ) -> None:
        """GetSegment, its replies already serialized (`add_to_server` registers it: the
        protobuf-object path of the generated base class is never served).

        A reader that takes no frame for the idle timeout is cut (StreamStalled), so a
        stalled reader cannot pin a payload in memory for as long as it likes.
        """
        stored = await self._found(request, context)
        idle_timeout_s = self._uploads.idle_timeout_s
        for frame in convert.segment_frames(stored, self._chunk_nbytes):
            try:
                async with asyncio.timeout(idle_timeout_s):
                    await context.write(frame)
            except TimeoutError as error:
                raise StreamStalled(
                    f"GetSegment reader took nothing for {idle_timeout_s} s; cut by the server"
                ) from error
        self._metrics.add_bytes("out", stored.meta.payload_nbytes)

    async def _found(
        self, request: pb.GetSegmentRequest, context: aio.ServicerContext
    ) -> StoredSegment:
        namespace = self._allow(context, request.namespace)
        nbytes = self._segments.stored_nbytes(namespace, request.context_key)
        stored = await _offloaded(
            nbytes, self._segments.fetch, namespace, request.context_key, request.model_fingerprint
        )
        self._segments.count_read(stored)
        if stored is None:
            raise NotFound(f"no segment {request.context_key.hex()} in {namespace!r}")
        self._metrics.record_read("grpc")
        return stored

    async def LookupPrefix(
        self, request: pb.LookupPrefixRequest, context: aio.ServicerContext
    ) -> pb.LookupPrefixResponse:
        namespace = self._allow(context, request.namespace)
        session_id = checked_session(request.session_id)  # refused before any work
        probe = self._segments.lookup_local(namespace, request.model_fingerprint, request.token_ids)
        match = probe.match
        if probe.extendable:
            match = await asyncio.to_thread(self._segments.extend_shared, probe)
        match = self._segments.counted(namespace, match)
        if session_id:
            self._hold_matched(context, namespace, session_id, match.segments)
        num_queried = len(request.token_ids)
        self._metrics.record_lookup(
            "exact", match.num_matched_tokens > 0, num_queried, match.num_matched_tokens
        )
        return convert.prefix_response(match)

    def _hold_matched(
        self, context: aio.ServicerContext, namespace: str, session_id: str, segments: Any
    ) -> None:
        """A writer's session holds what its lookup matched; a reader's is not held."""
        try:
            self._allow(context, namespace, write=True)
        except PermissionDenied:
            return
        self._segments.sessions.hold(namespace, session_id, [m.context_key for m in segments])

    async def RenewSession(
        self, request: pb.SessionRenewRequest, context: aio.ServicerContext
    ) -> pb.SessionRenewResponse:
        namespace = self._allow(context, request.namespace, write=True)
        hold = self._segments.sessions.hold(
            namespace, request.session_id, (), request.lease_s or None
        )
        return pb.SessionRenewResponse(
            outcome=hold.outcome.value, lease_s=hold.lease_s, reason=hold.reason
        )

    async def EndSession(
        self, request: pb.SessionEndRequest, context: aio.ServicerContext
    ) -> pb.SessionEndResponse:
        namespace = self._allow(context, request.namespace, write=True)
        return pb.SessionEndResponse(
            ended=self._segments.sessions.end(namespace, request.session_id)
        )

    async def FindSimilar(
        self, request: pb.FindSimilarRequest, context: aio.ServicerContext
    ) -> pb.FindSimilarResponse:
        self._allow(context, request.namespace)
        matches = self._segments.find_similar(convert.similar_query(request))
        num_queried = len(request.token_ids)
        self._metrics.record_lookup(
            "similar", bool(matches), num_queried, similar_hit_tokens(matches, num_queried)
        )
        return convert.similar_response(matches, request.with_token_ids)

    async def PutAnchor(
        self, request_iterator: AsyncIterator[pb.PutAnchorRequest], context: aio.ServicerContext
    ) -> pb.PutAnchorResponse:
        # The stream is bounded by max_anchor_nbytes; its namespace is known once it is read.
        write = await convert.receive_anchor(
            convert.within_idle_timeout(
                request_iterator, self._uploads.idle_timeout_s, "PutAnchor"
            ),
            self._anchors.config.max_anchor_nbytes,
        )
        self._allow(context, write.namespace, write=True)
        evicted = self._anchors.put(write)
        return pb.PutAnchorResponse(evicted_anchor_ids=evicted)

    async def GetAnchors(
        self, request: pb.GetAnchorsRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.GetAnchorsResponse]:
        records = self._anchors.get(
            self._allow(context, request.namespace),
            request.model_fingerprint,
            request.placeholder_id,
            request.include_payloads,
            tuple(request.anchor_ids),
            request.agent_id,
        )
        for response in convert.anchors_responses(records, self._chunk_nbytes):
            yield response

    async def TouchAnchors(
        self, request: pb.TouchAnchorsRequest, context: aio.ServicerContext
    ) -> pb.TouchAnchorsResponse:
        # A reader's worker counts the activations of anchors it used: touching is a read.
        num_touched = self._anchors.touch(
            self._allow(context, request.namespace),
            request.model_fingerprint,
            request.placeholder_id,
            request.anchor_ids,
        )
        return pb.TouchAnchorsResponse(num_touched=num_touched)

    async def Delete(
        self, request: pb.DeleteRequest, context: aio.ServicerContext
    ) -> pb.DeleteResponse:
        namespace = self._allow(context, request.namespace, write=True)
        return pb.DeleteResponse(deleted=self._segments.delete(namespace, request.context_key))

    async def Stats(
        self, request: pb.StatsRequest, context: aio.ServicerContext
    ) -> pb.StatsResponse:
        namespace = self._allow(context, request.namespace)
        return stats_response(self._segments.namespace_stats(namespace)[namespace])

    async def ReportReuse(
        self, request: pb.ReportReuseRequest, context: aio.ServicerContext
    ) -> pb.ReportReuseResponse:
        # A write into the caller's own namespace: a reader cannot inflate its stats,
        # nobody another tenant's; segment reads count only for keys stored there.
        namespace = self._allow(context, request.namespace, write=True)
        report = convert.reuse_report(request)
        num_counted = self._segments.record_reuse(namespace, report)
        self._metrics.record_reuse(report)
        return pb.ReportReuseResponse(num_reads_counted=num_counted)

    async def DescribeDataPlane(
        self, request: pb.DescribeDataPlaneRequest, context: aio.ServicerContext
    ) -> pb.DescribeDataPlaneResponse:
        self._allow(context, request.namespace)
        tenant = self._auth.authenticate(bearer_of(context.invocation_metadata()))
        # NOTE: the LMDB file holds every tenant's bytes and in-place reads skip these
        # checks, so only an admin credential (or no auth at all) is told where it is.
        if self._data_plane is None:
            return pb.DescribeDataPlaneResponse()
        return self._data_plane.to_response(in_place_reads=tenant.is_admin)


async def _offloaded(nbytes: int | None, function: Callable[..., T], *args: Any) -> T:
    """`function(*args)`, on a worker thread when it moves `nbytes` >= OFFLOAD_NBYTES or
    an unknown amount (None: a read through to the shared tier)."""
    if nbytes is None or nbytes >= OFFLOAD_NBYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)


def add_to_server(servicer: SegmentStoreServicer, server: aio.Server) -> None:
    """Register `servicer` like `store_pb2_grpc.add_SegmentStoreServicer_to_server`, except
    that PutSegment/GetSegment payload chunks skip protobuf objects (`proto.segment_stream`).

    NOTE: the bytes on the wire are the same; a multi-MiB chunk just avoids protobuf's
    copies into fresh pages (~20 ms per 8 MiB and direction on a loaded 2-core host).
    """
    handlers = {method.name: _protobuf_handler(servicer, method) for method in _SERVICE.methods}
    handlers["PutSegment"] = grpc.stream_unary_rpc_method_handler(
        servicer.PutSegment,
        request_deserializer=convert.parse_put_request,
        response_serializer=pb.PutSegmentResponse.SerializeToString,
    )
    handlers["GetSegment"] = grpc.unary_stream_rpc_method_handler(
        servicer.get_segment_frames,
        request_deserializer=pb.GetSegmentRequest.FromString,
        response_serializer=None,  # the frames are already bytes
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _protobuf_handler(
    servicer: SegmentStoreServicer, method: MethodDescriptor
) -> grpc.RpcMethodHandler:
    """The handler the generated registration builds for `method`."""
    factory = _HANDLER_FACTORIES[method.client_streaming, method.server_streaming]
    return factory(
        getattr(servicer, method.name),
        request_deserializer=getattr(pb, method.input_type.name).FromString,
        response_serializer=getattr(pb, method.output_type.name).SerializeToString,
    )
