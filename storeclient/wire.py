"""Client-side protobuf ⇄ domain conversion; protobuf never leaves this module.

Builds requests, chunks payloads, turns responses into `results` records, and
verifies a segment read back (length and xxh3-64 against its header). Payload chunks
travel as `proto.segment_stream`, not as protobuf objects (see `PUT_SEGMENT`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, TypeAlias

import xxhash

from kvsplice.common.buffers import BufferPool, writable_buffer
from kvsplice.common.errors import CorruptPayload, InvalidRequest
from kvsplice.common.keys import KEY_NBYTES
from kvsplice.common.reuse_report import ReuseReport
from kvsplice.common.segment import SegmentMeta
from kvsplice.proto import segment_stream
from kvsplice.proto import store_pb2 as pb
from kvsplice.proto.segment_stream import chunk_view, encode_chunk, meta_to_header
from kvsplice.storeclient.results import (
    AnchorEntry,
    DataPlaneInfo,
    PrefixLookup,
    SegmentRef,
    SessionRenewal,
    SimilarCandidate,
)

_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SegmentStore"].full_name


def to_context_key(segment_id_or_key: str | bytes) -> bytes:
    """A 16-byte context key from its hex form (segment id) or the raw key."""
    if isinstance(segment_id_or_key, bytes):
        key = segment_id_or_key
    else:
        try:
            key = bytes.fromhex(segment_id_or_key)
        except ValueError as error:
            raise InvalidRequest(f"segment id {segment_id_or_key!r} is not hex") from error
    if len(key) != KEY_NBYTES:
        raise InvalidRequest(f"segment id must name {KEY_NBYTES} bytes, got {len(key)}")
    return key


def with_payload_digest(meta: SegmentMeta, payload: bytes) -> SegmentMeta:
    """`meta` with payload_nbytes and checksum filled in when the caller left both unset."""
    if meta.payload_nbytes or meta.checksum:
        return meta
    return replace(meta, payload_nbytes=len(payload), checksum=xxhash.xxh3_64_intdigest(payload))


def header_to_meta(header: pb.SegmentHeader) -> SegmentMeta:
    """The server's header as `SegmentMeta`; a malformed one is a corrupt reply."""
    try:
        return segment_stream.header_to_meta(header, keep_created_at=True)
    except ValueError as error:
        raise CorruptPayload(f"segment header from the store is malformed: {error}") from error


def put_requests(
    meta: SegmentMeta, payload: bytes, chunk_nbytes: int
) -> Iterator[pb.PutSegmentRequest]:
    """Header first, then the payload in chunks of at most `chunk_nbytes`."""
    yield pb.PutSegmentRequest(header=meta_to_header(meta))
    view = memoryview(payload)
    for start in range(0, len(payload), chunk_nbytes):
        yield pb.PutSegmentRequest(chunk=view[start : start + chunk_nbytes].tobytes())


def put_header(meta: SegmentMeta, session_id: str = "") -> bytes:
    """A put's first message: the segment's header, with the session it is held for."""
    header = meta_to_header(meta)
    header.session_id = session_id
    return pb.PutSegmentRequest(header=header).SerializeToString()


def put_frames(
    meta: SegmentMeta, payload: bytes, chunk_nbytes: int, session_id: str = ""
) -> Iterator[bytes]:
    """`put_requests` already serialized, each chunk copied once, straight out of `payload`."""
    yield put_header(meta, session_id)
    view = memoryview(payload)
    for start in range(0, len(payload), chunk_nbytes):
        yield encode_chunk(view[start : start + chunk_nbytes])


def staged_put_request(
    meta: SegmentMeta, name: str, offset: int, session_id: str = ""
) -> pb.PutStagedSegmentRequest:
    """A PutStagedSegment request: the put's payload waits in staging file `name` at `offset`."""
    header = meta_to_header(meta)
    header.session_id = session_id
    return pb.PutStagedSegmentRequest(
        header=header, staged=pb.StagedPayload(name=name, offset=offset)
    )


GetPart: TypeAlias = pb.GetSegmentResponse | memoryview


def parse_get_response(message: bytes) -> GetPart:
    """A GetSegment reply: a chunk as a zero-copy view of `message`, anything else parsed."""
    chunk = chunk_view(message)
    return pb.GetSegmentResponse.FromString(message) if chunk is None else chunk


class StreamMethod(NamedTuple):
    """A segment RPC as `channel.stream_unary(*method)` / `unary_stream(*method)` take it."""

    path: str
    request_serializer: Callable[[Any], bytes] | None  # None: requests are already bytes
    response_deserializer: Callable[[bytes], Any]


# NOTE: the generated stub would build and parse protobuf objects around every payload
# chunk: three copies into fresh pages per chunk (~20 ms per 8 MiB on a loaded 2-core
# host); these calls send `put_frames` and read `parse_get_response` instead.
PUT_SEGMENT = StreamMethod(f"/{_SERVICE_NAME}/PutSegment", None, pb.PutSegmentResponse.FromString)
PUT_STAGED_SEGMENT = StreamMethod(
    f"/{_SERVICE_NAME}/PutStagedSegment",
    pb.PutStagedSegmentRequest.SerializeToString,
    pb.PutSegmentResponse.FromString,
)
GET_SEGMENT = StreamMethod(
    f"/{_SERVICE_NAME}/GetSegment", pb.GetSegmentRequest.SerializeToString, parse_get_response
)


class SegmentAssembler:
    """Collects a GetSegment reply stream (header, then chunks) and verifies it.

    Chunks are copied into one buffer taken when the header announces the size (from
    `buffers`, a `common.buffers.BufferPool`, else fresh), then hashed in one pass.
    """

    def __init__(self, buffers: BufferPool | None = None) -> None:
        self._meta: SegmentMeta | None = None
        self._buffer: memoryview | None = None
        self._buffers = buffers
        self._nbytes = 0

    def feed(self, response: GetPart) -> None:
        """One reply: a parsed message, or a chunk as `parse_get_response` returns it."""
        chunk: bytes | memoryview
        if isinstance(response, memoryview):
            chunk = response
        elif response.WhichOneof("part") == "header":
            if self._meta is not None:
                raise CorruptPayload("store sent a second segment header")
            self._meta = header_to_meta(response.header)
            nbytes = self._meta.payload_nbytes
            self._buffer = self._buffers.take(nbytes) if self._buffers else writable_buffer(nbytes)
            return
        else:
            chunk = response.chunk  # read once: every read copies the bytes out
        if self._meta is None or self._buffer is None:
            raise CorruptPayload("store sent payload bytes before the segment header")
        end = self._nbytes + len(chunk)
        if end > self._meta.payload_nbytes:
            raise CorruptPayload(f"store sent more than {self._meta.payload_nbytes} payload bytes")
        self._buffer[self._nbytes : end] = chunk
        self._nbytes = end

    def finish(self) -> tuple[SegmentMeta, memoryview]:
        """The meta and the payload, verified against the header (length and xxh3-64)."""
        if self._meta is None or self._buffer is None:
            raise CorruptPayload("store ended the reply without a segment header")
        if self._nbytes != self._meta.payload_nbytes:
            raise CorruptPayload(
                f"payload is {self._nbytes} bytes, header says {self._meta.payload_nbytes}"
            )
        if xxhash.xxh3_64_intdigest(self._buffer) != self._meta.checksum:
            raise CorruptPayload(f"payload checksum mismatch for segment {self._meta.segment_id}")
        return self._meta, self._buffer


def get_request(namespace: str, key: bytes, model_fingerprint: str | None) -> pb.GetSegmentRequest:
    return pb.GetSegmentRequest(
        namespace=namespace, context_key=key, model_fingerprint=model_fingerprint or ""
    )


def lookup_request(
    namespace: str, fingerprint: str, token_ids: Sequence[int], session_id: str = ""
) -> pb.LookupPrefixRequest:
    return pb.LookupPrefixRequest(
        namespace=namespace, model_fingerprint=fingerprint, token_ids=token_ids,
        session_id=session_id,
    )  # fmt: skip


def session_renew_request(
    namespace: str, session_id: str, lease_s: float | None
) -> pb.SessionRenewRequest:
    return pb.SessionRenewRequest(namespace=namespace, session_id=session_id, lease_s=lease_s or 0)


def session_renewal(response: pb.SessionRenewResponse) -> SessionRenewal:
    return SessionRenewal(response.outcome, response.lease_s, response.reason)


def session_end_request(namespace: str, session_id: str) -> pb.SessionEndRequest:
    return pb.SessionEndRequest(namespace=namespace, session_id=session_id)


def similar_request(
    namespace: str,
    fingerprint: str,
    token_ids: Sequence[int],
    text: str,
    left_context_ids: Sequence[int],
    parent_key: bytes | None,
    limit: int,
) -> pb.FindSimilarRequest:
    return pb.FindSimilarRequest(
        namespace=namespace,
        model_fingerprint=fingerprint,
        token_ids=token_ids,
        text=text,
        left_context_ids=left_context_ids,
        parent_key=parent_key or b"",
        limit=limit,
    )


def put_anchor_requests(
    namespace: str,
    fingerprint: str,
    placeholder_id: str,
    anchor_id: str,
    base_payload: bytes,
    agent_payloads: Mapping[str, bytes],
    num_tokens: int,
    chunk_nbytes: int,
) -> Iterator[pb.PutAnchorRequest]:
    """The anchor's fields, then its payloads (base first) in chunks of `chunk_nbytes`."""
    yield pb.PutAnchorRequest(
        namespace=namespace,
        model_fingerprint=fingerprint,
        placeholder_id=placeholder_id,
        anchor_id=anchor_id,
        num_tokens=num_tokens,
    )
    for agent_id, payload in [("", base_payload), *agent_payloads.items()]:
        view = memoryview(payload)
        for start in range(0, len(view), chunk_nbytes):
            data = view[start : start + chunk_nbytes].tobytes()
            chunk = pb.AnchorChunk(anchor_id=anchor_id, agent_id=agent_id, data=data)
            yield pb.PutAnchorRequest(chunk=chunk)


class AnchorsAssembler:
    """Collects a GetAnchors reply stream: the anchors first, then their payload chunks."""

    def __init__(self) -> None:
        self._entries: list[pb.AnchorEntry] | None = None
        self._pieces: dict[tuple[str, str], list[bytes]] = {}

    def feed(self, response: pb.GetAnchorsResponse) -> None:
        if self._entries is None:
            self._entries = list(response.anchors)
            return
        if not response.HasField("chunk"):
            raise CorruptPayload("store sent a second anchor list")
        chunk = response.chunk
        self._pieces.setdefault((chunk.anchor_id, chunk.agent_id), []).append(chunk.data)

    def finish(self) -> list[AnchorEntry]:
        if self._entries is None:
            raise CorruptPayload("store ended the reply without the anchor list")
        listed = {entry.anchor_id for entry in self._entries}
        if any(anchor_id not in listed for anchor_id, _ in self._pieces):
            raise CorruptPayload("store sent payload chunks of an anchor it did not list")
        return [self._entry(entry) for entry in self._entries]

    def _entry(self, a: pb.AnchorEntry) -> AnchorEntry:
        agents = {
            agent_id: b"".join(parts)
            for (anchor_id, agent_id), parts in self._pieces.items()
            if anchor_id == a.anchor_id and agent_id
        }
        return AnchorEntry(
            anchor_id=a.anchor_id,
            num_tokens=a.num_tokens,
            activation_count=a.activation_count,
            created_seq=a.created_seq,
            base_payload=b"".join(self._pieces.get((a.anchor_id, ""), ())),
            agent_payloads=agents,
            agent_ids=tuple(a.agent_ids),
        )


def get_anchors_request(
    namespace: str,
    fingerprint: str,
    placeholder_id: str,
    include_payloads: bool,
    anchor_ids: Sequence[str] = (),
    agent_id: str | None = None,
) -> pb.GetAnchorsRequest:
    return pb.GetAnchorsRequest(
        namespace=namespace,
        model_fingerprint=fingerprint,
        placeholder_id=placeholder_id,
        include_payloads=include_payloads,
        anchor_ids=list(anchor_ids),
        agent_id=agent_id or "",
    )


def touch_anchors_request(
    namespace: str, fingerprint: str, placeholder_id: str, anchor_ids: Sequence[str]
) -> pb.TouchAnchorsRequest:
    return pb.TouchAnchorsRequest(
        namespace=namespace,
        model_fingerprint=fingerprint,
        placeholder_id=placeholder_id,
        anchor_ids=anchor_ids,
    )


def delete_request(namespace: str, key: bytes) -> pb.DeleteRequest:
    return pb.DeleteRequest(namespace=namespace, context_key=key)


def stats_request(namespace: str) -> pb.StatsRequest:
    return pb.StatsRequest(namespace=namespace)


def report_request(namespace: str, report: ReuseReport) -> pb.ReportReuseRequest:
    hit = report.hit_tokens
    return pb.ReportReuseRequest(
        namespace=namespace,
        num_calls=report.num_calls,
        num_prompt_tokens=report.num_prompt_tokens,
        num_local_hit_tokens=hit.get("local", 0),
        num_in_place_hit_tokens=hit.get("in_place", 0),
        num_grpc_hit_tokens=hit.get("grpc", 0),
        num_approximate_hit_tokens=report.num_approximate_hit_tokens,
        reads=[
            pb.SegmentReads(context_key=key, served=served, num_reads=n)
            for (key, served), n in report.segment_reads.items()
        ],
    )


def data_plane_request(namespace: str) -> pb.DescribeDataPlaneRequest:
    return pb.DescribeDataPlaneRequest(namespace=namespace)


def data_plane_result(response: pb.DescribeDataPlaneResponse) -> DataPlaneInfo:
    return DataPlaneInfo(
        host_id=response.host_id,
        lmdb_path=response.lmdb_path,
        lmdb_file_id=(response.lmdb_device, response.lmdb_inode),
        server_pid=response.server_pid,
        staging_dir=response.staging_dir,
    )


def _ref(ref: pb.SegmentRef) -> SegmentRef:
    return SegmentRef(
        context_key=ref.context_key,
        start_position=ref.start_position,
        num_tokens=ref.num_tokens,
        layer_start=ref.layer_start,
        layer_end=ref.layer_end,
        payload_nbytes=ref.payload_nbytes,
    )


def lookup_result(response: pb.LookupPrefixResponse) -> PrefixLookup:
    segments = tuple(_ref(ref) for ref in response.segments)
    return PrefixLookup(segments=segments, num_matched_tokens=response.num_matched_tokens)


def similar_result(response: pb.FindSimilarResponse) -> list[SimilarCandidate]:
    return [
        SimilarCandidate(
            segment=_ref(c.segment),
            estimated_jaccard=c.estimated_jaccard,
            exact_tokens=c.exact_tokens,
            same_left_context=c.same_left_context,
            exact_window=c.exact_window,
            token_ids=tuple(c.token_ids),
            exact=c.exact,
        )
        for c in response.candidates
    ]
