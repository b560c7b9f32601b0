"""Server-side protobuf ⇄ domain conversion, including the segment stream protocol.

Protobuf stops here. A malformed message raises `InvalidRequest`; a payload stream
whose bytes disagree with its header raises `CorruptPayload`. Payload chunks may
also travel as `proto.segment_stream` (`parse_put_request`, `segment_frames`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Sequence
from typing import TypeAlias, TypeVar, cast

from kvsplice.common.errors import CorruptPayload, InvalidRequest, StreamStalled
from kvsplice.common.reuse_report import MAX_REPORTED_SEGMENTS, SERVED, ReuseReport, Served
from kvsplice.common.segment import SegmentMeta
from kvsplice.index.exact_index import PrefixMatch
from kvsplice.index.similarity_index import SimilarMatch
from kvsplice.proto import segment_stream
from kvsplice.proto import store_pb2 as pb
from kvsplice.proto.segment_stream import chunk_view, encode_chunk, meta_to_header
from kvsplice.server.anchor_service import AnchorRecord, AnchorWrite
from kvsplice.server.segment_service import SimilarQuery
from kvsplice.storage.tiered_store import StoredSegment

HeaderCheck = Callable[[SegmentMeta], SegmentMeta]
PutPart: TypeAlias = pb.PutSegmentRequest | memoryview  # a parsed message, or a chunk's bytes
_SEGMENT_REF_FIELDS = tuple(pb.SegmentRef.DESCRIPTOR.fields_by_name)


def header_to_meta(header: pb.SegmentHeader) -> SegmentMeta:
    """The header as `SegmentMeta` (created_at_s is the server's to set, so it is dropped)."""
    try:
        return segment_stream.header_to_meta(header, keep_created_at=False)
    except ValueError as error:
        raise InvalidRequest(f"bad segment header: {error}") from error


def parse_put_request(message: bytes) -> PutPart:
    """A PutSegment message: a chunk as a zero-copy view of `message`, anything else parsed."""
    chunk = chunk_view(message)
    return pb.PutSegmentRequest.FromString(message) if chunk is None else chunk


T = TypeVar("T")


async def within_idle_timeout(
    requests: AsyncIterable[T], idle_timeout_s: float | None, rpc: str
) -> AsyncIterator[T]:
    """`requests`, but StreamStalled when the next message takes over `idle_timeout_s`."""
    iterator = aiter(requests)
    while True:
        try:
            async with asyncio.timeout(idle_timeout_s):
                request = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError as error:
            raise StreamStalled(
                f"{rpc} stream sent nothing for {idle_timeout_s} s; cut by the server"
            ) from error
        yield request


async def receive_segment(
    requests: AsyncIterable[PutPart],
    check_header: HeaderCheck,
    idle_timeout_s: float | None = None,
    on_header: Callable[[pb.SegmentHeader], None] | None = None,
) -> tuple[SegmentMeta, memoryview]:
    """Read a PutSegment stream: exactly one header, then chunks totalling payload_nbytes
    (a staged payload comes as one `PutStagedSegment` message instead).

    `check_header` validates the header before any payload byte is buffered, so
    an oversize or malformed put is refused without reading its payload. Chunks are
    kept as they came and joined once at the end (one copy, no zero-filled buffer).
    A stream silent for `idle_timeout_s` between messages raises `StreamStalled`.
    """
    meta: SegmentMeta | None = None
    chunks: list[bytes | memoryview] = []
    num_received = 0
    async for request in within_idle_timeout(requests, idle_timeout_s, "PutSegment"):
        part = _put_part(request)
        if isinstance(part, pb.SegmentHeader):
            if meta is not None:
                raise InvalidRequest("PutSegment stream holds a second header")
            meta = check_header(header_to_meta(part))
            if on_header is not None:  # the fields that are not the segment's (session_id)
                on_header(part)
            continue
        if meta is None:
            raise InvalidRequest("PutSegment stream sent payload bytes before its header")
        num_received += len(part)
        if num_received > meta.payload_nbytes:
            raise CorruptPayload(
                f"payload exceeds the {meta.payload_nbytes} bytes its header declares"
            )
        chunks.append(part)
    if meta is None:
        raise InvalidRequest("PutSegment stream ended without a header")
    if num_received != meta.payload_nbytes:
        raise CorruptPayload(
            f"stream ended after {num_received} of {meta.payload_nbytes} payload bytes"
        )
    return meta, memoryview(b"".join(chunks))


def _put_part(request: PutPart) -> pb.SegmentHeader | bytes | memoryview:
    """What a PutSegment message carries: its header or its chunk's bytes."""
    if isinstance(request, memoryview):
        return request
    part = request.WhichOneof("part")
    if part is None:
        raise InvalidRequest("PutSegment message holds neither header nor chunk")
    return request.header if part == "header" else request.chunk  # each read copies: read once


def segment_frames(stored: StoredSegment, chunk_nbytes: int) -> Iterator[bytes]:
    """GetSegment's serialized replies: the header, then the payload in chunks of at most
    `chunk_nbytes`, each copied once out of the stored view."""
    yield pb.GetSegmentResponse(header=meta_to_header(stored.meta)).SerializeToString()
    view = memoryview(stored.payload)
    for start in range(0, view.nbytes, chunk_nbytes):
        yield encode_chunk(view[start : start + chunk_nbytes])


def _segment_ref(meta: SegmentMeta) -> pb.SegmentRef:
    """Each field of the reference is the meta's attribute of the same name."""
    return pb.SegmentRef(**{name: getattr(meta, name) for name in _SEGMENT_REF_FIELDS})


def prefix_response(match: PrefixMatch) -> pb.LookupPrefixResponse:
    return pb.LookupPrefixResponse(
        segments=[_segment_ref(meta) for meta in match.segments],
        num_matched_tokens=match.num_matched_tokens,
    )


def similar_query(request: pb.FindSimilarRequest) -> SimilarQuery:
    return SimilarQuery(
        namespace=request.namespace,
        model_fingerprint=request.model_fingerprint,
        token_ids=tuple(request.token_ids),
        text=request.text,
        left_context_ids=tuple(request.left_context_ids),
        parent_key=request.parent_key or None,
        limit=request.limit,
    )


def similar_response(
    matches: Sequence[SimilarMatch], with_token_ids: bool = False
) -> pb.FindSimilarResponse:
    """`with_token_ids`: each candidate with its tokens and `exact` too, from the meta the
    index holds (in memory, the catalog's: no record or payload byte is read)."""
    return pb.FindSimilarResponse(
        candidates=[
            pb.SimilarCandidate(
                segment=_segment_ref(m.meta),
                estimated_jaccard=m.estimated_jaccard,
                exact_tokens=m.exact_tokens,
                same_left_context=m.same_left_context,
                exact_window=m.exact_window,
                token_ids=m.meta.token_ids if with_token_ids else (),
                exact=m.meta.exact and with_token_ids,
            )
            for m in matches
        ]
    )


async def receive_anchor(
    requests: AsyncIterable[pb.PutAnchorRequest], max_nbytes: int
) -> AnchorWrite:
    """Read a PutAnchor stream: the anchor's fields first, then its payloads as chunks.

    Bytes past `max_nbytes` are refused as they arrive (nothing larger is buffered).
    """
    first: pb.PutAnchorRequest | None = None
    pieces: dict[str, list[bytes]] = {}
    num_received = 0
    async for request in requests:
        if first is None:
            first = request
            num_received = len(request.base_payload) + sum(
                len(p) for p in request.agent_payloads.values()
            )
        elif not request.HasField("chunk"):
            raise InvalidRequest("PutAnchor message after the first holds no chunk")
        else:
            chunk = request.chunk
            if chunk.anchor_id and chunk.anchor_id != first.anchor_id:
                raise InvalidRequest(f"chunk of anchor {chunk.anchor_id!r} in another's stream")
            data = chunk.data  # read once: every read copies
            num_received += len(data)
            pieces.setdefault(chunk.agent_id, []).append(data)
        if num_received > max_nbytes:
            raise InvalidRequest(f"anchor payloads exceed the limit of {max_nbytes} bytes")
    if first is None:
        raise InvalidRequest("PutAnchor stream is empty")
    return _anchor_write(first, pieces)


def _anchor_write(first: pb.PutAnchorRequest, pieces: dict[str, list[bytes]]) -> AnchorWrite:
    agent_payloads = dict(first.agent_payloads)
    for agent_id, parts in pieces.items():
        if agent_id:
            agent_payloads[agent_id] = agent_payloads.get(agent_id, b"") + b"".join(parts)
    return AnchorWrite(
        namespace=first.namespace,
        model_fingerprint=first.model_fingerprint,
        placeholder_id=first.placeholder_id,
        anchor_id=first.anchor_id,
        base_payload=first.base_payload + b"".join(pieces.get("", ())),
        agent_payloads=agent_payloads,
        num_tokens=first.num_tokens,
    )


def anchors_responses(
    records: Sequence[AnchorRecord], chunk_nbytes: int
) -> Iterator[pb.GetAnchorsResponse]:
    """The anchors without payloads first, then every payload in chunks, in order."""
    yield pb.GetAnchorsResponse(
        anchors=[
            pb.AnchorEntry(
                anchor_id=r.anchor_id,
                num_tokens=r.num_tokens,
                activation_count=r.activation_count,
                created_seq=r.created_seq,
                agent_ids=list(r.agent_ids),
            )
            for r in records
        ]
    )
    for record in records:
        payloads = [("", record.base_payload), *record.agent_payloads.items()]
        for agent_id, payload in payloads:
            view = memoryview(payload)
            for start in range(0, len(view), chunk_nbytes):
                data = view[start : start + chunk_nbytes].tobytes()
                chunk = pb.AnchorChunk(anchor_id=record.anchor_id, agent_id=agent_id, data=data)
                yield pb.GetAnchorsResponse(chunk=chunk)


def reuse_report(request: pb.ReportReuseRequest) -> ReuseReport:
    """A worker's report, validated (`InvalidRequest` naming what is wrong)."""
    if len(request.reads) > MAX_REPORTED_SEGMENTS:
        raise InvalidRequest(f"{len(request.reads)} segment reads > {MAX_REPORTED_SEGMENTS}")
    hit_tokens: dict[Served, int] = {
        "local": request.num_local_hit_tokens,
        "in_place": request.num_in_place_hit_tokens,
        "grpc": request.num_grpc_hit_tokens,
    }
    reads: dict[tuple[bytes, Served], int] = {}
    try:
        for r in request.reads:
            if r.served not in SERVED:
                raise ValueError(f"served {r.served!r} is not one of {SERVED}")
            if r.num_reads < 0:
                raise ValueError(f"num_reads {r.num_reads} < 0")
            slot = (r.context_key, cast(Served, r.served))
            reads[slot] = reads.get(slot, 0) + r.num_reads
        return ReuseReport(
            request.num_calls, request.num_prompt_tokens, hit_tokens, reads,
            request.num_approximate_hit_tokens,
        )  # fmt: skip
    except ValueError as error:
        raise InvalidRequest(f"bad reuse report: {error}") from error
