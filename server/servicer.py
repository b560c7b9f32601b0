"""The grpc.aio servicer of `kvsplice.v1.SegmentStore`: decode, call the domain, encode.

Methods raise domain errors (`interceptors.FaultInterceptor` maps them); a GetSegment
miss ends with NOT_FOUND, which clients read as a miss. Records byte and lookup metrics.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from grpc import aio

from kvsplice.common.errors import NotFound
from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc
from kvsplice.server import convert
from kvsplice.server.anchor_service import AnchorService
from kvsplice.server.metrics import StoreMetrics
from kvsplice.server.segment_service import SegmentService, check_namespace

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SegmentStore"].full_name
RPC_METHODS = tuple(m.name for m in pb.DESCRIPTOR.services_by_name["SegmentStore"].methods)


class SegmentStoreServicer(store_pb2_grpc.SegmentStoreServicer):
    def __init__(
        self,
        segments: SegmentService,
        anchors: AnchorService,
        metrics: StoreMetrics,
        chunk_nbytes: int,
    ) -> None:
        self._segments = segments
        self._anchors = anchors
        self._metrics = metrics
        self._chunk_nbytes = chunk_nbytes

    async def PutSegment(
        self, request_iterator: AsyncIterator[pb.PutSegmentRequest], context: aio.ServicerContext
    ) -> pb.PutSegmentResponse:
        meta, payload = await convert.receive_segment(request_iterator, self._segments.check_header)
        stored = self._segments.put(meta, payload)
        self._metrics.add_bytes("in", stored.payload_nbytes)
        self._metrics.observe_segment_size(stored.payload_nbytes)
        return pb.PutSegmentResponse(context_key=stored.context_key)

    async def GetSegment(
        self, request: pb.GetSegmentRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.GetSegmentResponse]:
        stored = self._segments.get(
            request.namespace, request.context_key, request.model_fingerprint
        )
        if stored is None:
            raise NotFound(f"no segment {request.context_key.hex()} in {request.namespace!r}")
        for response in convert.segment_responses(stored, self._chunk_nbytes):
            yield response
        self._metrics.add_bytes("out", stored.meta.payload_nbytes)

    async def LookupPrefix(
        self, request: pb.LookupPrefixRequest, context: aio.ServicerContext
    ) -> pb.LookupPrefixResponse:
        match = self._segments.lookup_prefix(
            request.namespace, request.model_fingerprint, request.token_ids
        )
        num_queried = len(request.token_ids)
        self._metrics.record_lookup(
            "exact", match.num_matched_tokens > 0, num_queried, match.num_matched_tokens
        )
        return convert.prefix_response(match)

    async def FindSimilar(
        self, request: pb.FindSimilarRequest, context: aio.ServicerContext
    ) -> pb.FindSimilarResponse:
        matches = self._segments.find_similar(convert.similar_query(request))
        num_queried = len(request.token_ids)
        num_exact = max((m.meta.num_tokens for m in matches if m.exact_tokens), default=0)
        self._metrics.record_lookup(
            "similar", bool(matches), num_queried, min(num_exact, num_queried)
        )
        return convert.similar_response(matches)

    async def PutAnchor(
        self, request: pb.PutAnchorRequest, context: aio.ServicerContext
    ) -> pb.PutAnchorResponse:
        evicted = self._anchors.put(convert.anchor_write(request))
        return pb.PutAnchorResponse(evicted_anchor_ids=evicted)

    async def GetAnchors(
        self, request: pb.GetAnchorsRequest, context: aio.ServicerContext
    ) -> pb.GetAnchorsResponse:
        records = self._anchors.get(
            request.namespace,
            request.model_fingerprint,
            request.placeholder_id,
            request.include_payloads,
        )
        return convert.anchors_response(records)

    async def TouchAnchors(
        self, request: pb.TouchAnchorsRequest, context: aio.ServicerContext
    ) -> pb.TouchAnchorsResponse:
        num_touched = self._anchors.touch(
            request.namespace, request.model_fingerprint, request.placeholder_id, request.anchor_ids
        )
        return pb.TouchAnchorsResponse(num_touched=num_touched)

    async def Delete(
        self, request: pb.DeleteRequest, context: aio.ServicerContext
    ) -> pb.DeleteResponse:
        return pb.DeleteResponse(
            deleted=self._segments.delete(request.namespace, request.context_key)
        )

    async def Stats(
        self, request: pb.StatsRequest, context: aio.ServicerContext
    ) -> pb.StatsResponse:
        (stats,) = self._segments.namespace_stats(check_namespace(request.namespace))
        return convert.stats_response(stats)
