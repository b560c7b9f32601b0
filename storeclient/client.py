"""The synchronous store client: one channel, per-call deadlines, retries, graceful misses.

Unreachable/slow store, NOT_FOUND or a bad checksum → a miss (one rate-limited warning
for faults), so the worker falls back to dense; server faults raise our errors. No torch.
Reuse reports go out through `common.reuse_report.ReuseReporter` (a call never waits on the
network).
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import grpc
import grpc.experimental
from cachetools import LRUCache

from kvsplice.common.buffers import BufferPool
from kvsplice.common.errors import CorruptPayload, InvalidRequest, StoreUnavailable
from kvsplice.common.namespace_stats import NamespaceStats
from kvsplice.common.reuse_report import ReusedRun, ReuseReport, ReuseReporter, Served, call_report
from kvsplice.common.segment import SegmentMeta, validate_namespace
from kvsplice.proto import store_pb2_grpc
from kvsplice.proto.stats_wire import stats_of
from kvsplice.storeclient import wire
from kvsplice.storeclient.channel import bearer_metadata, open_channel
from kvsplice.storeclient.config import ClientTls, StoreClientConfig
from kvsplice.storeclient.faults import (
    MIN_ATTEMPT_TIMEOUT_S,
    credential_error,
    error_from_rpc,
    retrying,
    warn_degraded,
)
from kvsplice.storeclient.put_staging import MIN_STAGED_NBYTES, PutStaging
from kvsplice.storeclient.results import (
    AnchorEntry,
    ClientCounters,
    DataPlaneInfo,
    PrefixLookup,
    SessionRenewal,
    SimilarCandidate,
)
from kvsplice.storeclient.same_host import SameHostPath

T = TypeVar("T")
# `_same_host` before the sidecar was asked where its data plane is.
_UNASKED = object()
MAX_REMEMBERED_READS = 4096  # how many segments' read path (`served_from`) a client remembers

# NOTE: by default every server-streaming call (GetSegment) starts a "channel spin"
# thread of its own (~2 ms on a loaded 2-core host); this makes the calling thread
# read its replies itself. Python-side option of the sync channel only.
SINGLE_THREADED_STREAMS = (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)

logger = logging.getLogger(__name__)


def checked_namespace(namespace: str) -> str:
    try:
        return validate_namespace(namespace)
    except ValueError as error:
        raise InvalidRequest(str(error)) from error


class StoreClient:
    """Talks to one store over one channel, scoped to one namespace."""

    def __init__(
        self,
        target: str,
        namespace: str,
        token: str | None = None,
        config: StoreClientConfig | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        self.target = target
        self.namespace = checked_namespace(namespace)
        self.config = config or StoreClientConfig()
        self.counters = ClientCounters()
        options = [*self.config.channel_options(), SINGLE_THREADED_STREAMS]
        self._channel = open_channel(target, options, tls)
        self._stub = store_pb2_grpc.SegmentStoreStub(self._channel)
        # NOTE: types-grpcio lacks grpcio's private `_registered_method` keyword (the
        # generated stubs pass it too): the ignores are for that stub gap only.
        self._put_segment = self._channel.stream_unary(*wire.PUT_SEGMENT, _registered_method=True)  # type: ignore[call-arg]
        self._put_staged_segment = self._channel.unary_unary(
            *wire.PUT_STAGED_SEGMENT, _registered_method=True
        )  # type: ignore[call-arg]
        self._get_segment = self._channel.unary_stream(*wire.GET_SEGMENT, _registered_method=True)  # type: ignore[call-arg]
        self._metadata = bearer_metadata(token)
        self._warn_degraded = functools.partial(warn_degraded, target, self.config.warn_interval_s)
        # One retry policy per deadline the idempotent calls use, built once; each call
        # iterates a copy of its deadline's policy.
        timeouts_s = {self.config.lookup_timeout_s, self.config.get_timeout_s}
        self._timeout_to_retrying = {t: retrying(self.config, t) for t in timeouts_s}
        self._buffers = BufferPool(self.config.receive_pool_bytes)
        self._same_host: SameHostPath | object | None = (
            _UNASKED if self.config.same_host_reads else None
        )
        self._staging: PutStaging | object | None = _UNASKED if self.config.staged_puts else None
        self._owns_staging = False  # a namespace client uses its owner's file if it had one
        self._served_lock = threading.Lock()
        self._served: LRUCache[bytes, Served] = LRUCache(maxsize=MAX_REMEMBERED_READS)
        self._reporter = ReuseReporter(self._send_report, self.config.report_interval_s)
        self._owns_channel = True

    def in_namespace(self, namespace: str) -> StoreClient:
        """A client for `namespace` over this client's channel: the same sidecar, token,
        TLS, retry policies and receive buffers, no connection of its own. Closing it
        leaves this client's channel open (close this one last)."""
        other = copy.copy(self)
        other.namespace = checked_namespace(namespace)
        other.counters = ClientCounters()
        other._same_host = _UNASKED if self.config.same_host_reads else None
        other._owns_staging = False
        other._served_lock = threading.Lock()
        other._served = LRUCache(maxsize=MAX_REMEMBERED_READS)
        other._reporter = ReuseReporter(other._send_report, self.config.report_interval_s)
        other._owns_channel = False
        return other

    def put_segment(self, meta: SegmentMeta, payload: bytes, session_id: str = "") -> bool:
        """Store `payload` under `meta`; True once the store holds a segment under its key
        (this one, or an earlier one with other bytes: keys are immutable, the first
        stays); False if the store could not be reached in time. `session_id`: the agent
        session it is held for (empty: none)."""
        if meta.namespace != self.namespace:
            raise InvalidRequest(
                f"segment namespace {meta.namespace!r} != client's {self.namespace!r}"
            )
        meta = wire.with_payload_digest(meta, payload)

        def send(timeout_s: float) -> bool:
            try:
                if not self._put_staged(meta, payload, timeout_s, session_id):
                    frames = wire.put_frames(meta, payload, self.config.chunk_nbytes, session_id)
                    self._put_segment(frames, timeout=timeout_s, metadata=self._metadata)
            except grpc.RpcError as error:
                if error.code() is not grpc.StatusCode.ALREADY_EXISTS:  # type: ignore[attr-defined]
                    raise
                # NOTE: the key is held: its segment is these tokens after this same left
                # context (an earlier put, its bytes kept), so a key chain through it holds.
                logger.debug("segment %s already stored; the first copy stays", meta.segment_id)
            return True

        return self._once("put_segment", send, self.config.put_timeout_s, False)

    def _put_staged(self, meta: SegmentMeta, payload: bytes, timeout_s: float, sid: str) -> bool:
        """Put through the staging file when the sidecar is on this host; False: stream it
        (too small, elsewhere, the file busy or full, or the sidecar cannot read it)."""
        staging = self._put_staging() if len(payload) >= MIN_STAGED_NBYTES else None
        if staging is None:
            return False
        with staging.staged(payload) as where:
            if where is None:
                return False
            request = wire.staged_put_request(meta, *where, sid)
            try:
                self._put_staged_segment(request, timeout=timeout_s, metadata=self._metadata)
            except grpc.RpcError as error:
                if error.code() is not grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                    raise
                # e.g. another user's sidecar, or another /dev/shm (a container)
                logger.warning(
                    "the sidecar cannot read this process's staged puts (%s): streaming them",
                    error.details(),  # type: ignore[attr-defined]
                )
                self._staging = None
                return False
        self.counters.num_staged_puts += 1
        return True

    def _put_staging(self) -> PutStaging | None:
        """The staging file, asking the sidecar once where it takes staged puts."""
        if isinstance(self._staging, PutStaging) and not self._staging.usable:
            self._staging = _UNASKED  # forked since it opened: a file of this process's own
        if self._staging is _UNASKED:
            answered, plane = self._describe_data_plane()
            if not answered:
                return None
            self._staging = None if plane is None else PutStaging.open(plane)
            self._owns_staging = self._staging is not None
        return self._staging if isinstance(self._staging, PutStaging) else None

    def get_segment(
        self, segment_id_or_context_key: str | bytes, *, model_fingerprint: str | None = None
    ) -> tuple[SegmentMeta, bytes | memoryview] | None:
        """The segment's meta and verified payload, or None (absent, corrupt or unreachable).

        On the sidecar's host the payload is a read-only view into its LMDB map
        (`storeclient.same_host`), valid for as long as the caller holds it; elsewhere bytes
        streamed over gRPC. Either way namespace, expiry, fingerprint and checksum hold.
        """
        key = wire.to_context_key(segment_id_or_context_key)
        try:
            local = self._same_host_path()
            if local is not None:
                try:
                    found = local.get_segment(key, model_fingerprint)
                    self.counters.num_same_host_reads += 1
                    self._remember_read(key, "in_place", found)
                    return found
                except StoreUnavailable as error:  # this read goes over gRPC; ask again next
                    self._warn_degraded("get_segment (same host)", str(error))
                    local.close()
                    self._same_host = _UNASKED
            fetched = self._get_over_grpc(key, model_fingerprint)
            self._remember_read(key, "grpc", fetched)
            return fetched
        except CorruptPayload as error:
            self.counters.num_corrupt_payloads += 1
            self._warn_degraded("get_segment", str(error))
            return None

    def served_from(self, context_key: bytes | None) -> Served:
        """Where this client's last read of `context_key` was served ("in_place" or
        "grpc"); for a key it has not read (or forgot, or None), where a read goes now."""
        with self._served_lock:
            served = None if context_key is None else self._served.get(context_key)
        if served is not None:
            return served
        return "in_place" if isinstance(self._same_host, SameHostPath) else "grpc"

    def report_reuse(self, num_prompt_tokens: int, reused: Sequence[ReusedRun] = ()) -> None:
        """Count one call of `num_prompt_tokens` prompt tokens that reused `reused`.

        Queued, never sent on the caller's thread: a background flush sends what
        accumulated every `config.report_interval_s` (and `flush_reports`, `close`).
        The sidecar adds it to the namespace's `/v1/stats`, `/metrics` and dashboard:
        every token a worker reused, whether served from its own tier ("local"), read
        in place ("in_place", see `served_from`) or over gRPC. Needs the writer role.
        """
        self._reporter.add(call_report(num_prompt_tokens, reused))

    def flush_reports(self) -> bool:
        """Send the queued reuse reports now; False if the store could not be reached."""
        return self._reporter.flush()

    def _remember_read(self, key: bytes, served: Served, found: object | None) -> None:
        if found is not None:
            with self._served_lock:
                self._served[key] = served

    def _send_report(self, report: ReuseReport) -> bool:
        """Send `report`; False (keep it) if the store could not be reached. A refused
        report (a reader's token, an older sidecar) is dropped, counted, logged once."""
        request = wire.report_request(self.namespace, report)
        try:
            self._stub.ReportReuse(
                request, timeout=self.config.lookup_timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as rpc_error:
            error = error_from_rpc(rpc_error)
            if isinstance(error, StoreUnavailable):  # the calls that need the store warn
                logger.debug("reuse report kept for the next flush: %s", error)
                return False
            if not self.counters.num_reports_dropped:
                logger.warning("the store refused a reuse report (%s); reports dropped", error)
            self.counters.num_reports_dropped += 1
            return True
        self.counters.num_reports_sent += 1
        return True

    def _get_over_grpc(
        self, key: bytes, model_fingerprint: str | None
    ) -> tuple[SegmentMeta, memoryview] | None:
        request = wire.get_request(self.namespace, key, model_fingerprint)

        def read(timeout_s: float) -> tuple[SegmentMeta, memoryview] | None:
            assembler = wire.SegmentAssembler(self._buffers)
            try:
                for response in self._get_segment(
                    request, timeout=timeout_s, metadata=self._metadata
                ):
                    assembler.feed(response)
            except grpc.RpcError as error:
                if error.code() is grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                    return None  # a miss is a value, not a fault
                raise
            return assembler.finish()

        return self._idempotent("get_segment", read, self.config.get_timeout_s, None)

    def _same_host_path(self) -> SameHostPath | None:
        """The same-host path, asking the sidecar once where it reads (None: gRPC only)."""
        if isinstance(self._same_host, SameHostPath) and not self._same_host.usable:
            self._same_host = _UNASKED  # forked since it opened: open it again
        if self._same_host is _UNASKED:
            answered, plane = self._describe_data_plane()
            if not answered:
                return None  # the get that follows reports it; ask again next time
            self._same_host = None if plane is None else SameHostPath.open(plane, self.namespace)
        return self._same_host if isinstance(self._same_host, SameHostPath) else None

    def _describe_data_plane(self) -> tuple[bool, DataPlaneInfo | None]:
        """(answered, where the sidecar reads and takes staged puts): (False, None) while
        it cannot be reached (ask again), (True, None) if it refused (an older sidecar)."""
        request = wire.data_plane_request(self.namespace)
        try:
            # NOTE: asked on the way to a get or put, so under the get's deadline: on a
            # loaded host the lookup deadline (0.5 s) sent first reads over gRPC needlessly.
            response = self._stub.DescribeDataPlane(
                request, timeout=self.config.get_timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as rpc_error:
            if isinstance(error_from_rpc(rpc_error), StoreUnavailable):
                return False, None
            return True, None
        return True, wire.data_plane_result(response)

    def lookup_prefix(
        self, model_fingerprint: str, token_ids: Sequence[int], session_id: str = ""
    ) -> PrefixLookup:
        """Stored segments chaining from position 0 over `token_ids` (then held by `session_id`,
        if any); MISS when none or degraded."""
        request = wire.lookup_request(self.namespace, model_fingerprint, token_ids, session_id)
        call = self._unary(self._stub.LookupPrefix, request, wire.lookup_result)
        return self._idempotent(
            "lookup_prefix", call, self.config.lookup_timeout_s, PrefixLookup.MISS
        )

    def find_similar(
        self,
        model_fingerprint: str,
        token_ids: Sequence[int],
        *,
        text: str = "",
        left_context_ids: Sequence[int] = (),
        parent_key: bytes | None = None,
        limit: int = 0,
        with_token_ids: bool = False,
    ) -> list[SimilarCandidate]:
        """Verified similar segments, best first; [] when none or degraded. `with_token_ids`:
        each with its `token_ids` and `exact` too (the sidecar reads no payload for them)."""
        request = wire.similar_request(
            self.namespace, model_fingerprint, token_ids, text, left_context_ids, parent_key, limit
        )
        request.with_token_ids = with_token_ids
        call = self._unary(self._stub.FindSimilar, request, wire.similar_result)
        return self._idempotent("find_similar", call, self.config.lookup_timeout_s, [])

    def put_anchor(
        self,
        model_fingerprint: str,
        placeholder_id: str,
        anchor_id: str,
        base_payload: bytes,
        agent_payloads: Mapping[str, bytes],
        num_tokens: int,
    ) -> list[str] | None:
        """Add an anchor; the ids it evicted from the pool, or None if not stored (degraded)."""
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

        def send(timeout_s: float) -> list[str]:
            response = self._stub.PutAnchor(requests, timeout=timeout_s, metadata=self._metadata)
            return list(response.evicted_anchor_ids)

        return self._once("put_anchor", send, self.config.put_timeout_s, None)

    def get_anchors(
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

        def read(timeout_s: float) -> list[AnchorEntry]:
            assembler = wire.AnchorsAssembler()
            for response in self._stub.GetAnchors(
                request, timeout=timeout_s, metadata=self._metadata
            ):
                assembler.feed(response)
            return assembler.finish()

        try:
            return self._idempotent("get_anchors", read, self.config.get_timeout_s, [])
        except CorruptPayload as error:
            self.counters.num_corrupt_payloads += 1
            self._warn_degraded("get_anchors", str(error))
            return []

    def touch_anchors(
        self, model_fingerprint: str, placeholder_id: str, anchor_ids: Sequence[str]
    ) -> int:
        """Count an activation of each anchor; the number found (0 when degraded)."""
        request = wire.touch_anchors_request(
            self.namespace, model_fingerprint, placeholder_id, anchor_ids
        )
        call = self._unary(self._stub.TouchAnchors, request, lambda r: int(r.num_touched))
        return self._once("touch_anchors", call, self.config.lookup_timeout_s, 0)

    def delete(self, segment_id_or_context_key: str | bytes) -> bool:
        """Whether a segment was deleted (False if absent or the store is unreachable)."""
        key = wire.to_context_key(segment_id_or_context_key)
        request = wire.delete_request(self.namespace, key)
        call = self._unary(self._stub.Delete, request, lambda r: bool(r.deleted))
        return self._once("delete", call, self.config.lookup_timeout_s, False)

    def renew_session(self, session_id: str, lease_s: float | None = None) -> SessionRenewal | None:
        """Renew the session's lease (`lease_s`: a retain hint's); None if unreachable."""
        request = wire.session_renew_request(self.namespace, session_id, lease_s)
        call = self._unary(self._stub.RenewSession, request, wire.session_renewal)
        return self._once("renew_session", call, self.config.lookup_timeout_s, None)

    def end_session(self, session_id: str) -> bool:
        """Release the session's segments (a release hint); False if not live or unreachable."""
        request = wire.session_end_request(self.namespace, session_id)
        call = self._unary(self._stub.EndSession, request, lambda r: bool(r.ended))
        return self._once("end_session", call, self.config.lookup_timeout_s, False)

    def stats(self) -> NamespaceStats | None:
        request = wire.stats_request(self.namespace)
        call = self._unary(self._stub.Stats, request, stats_of)
        return self._idempotent("stats", call, self.config.lookup_timeout_s, None)

    def close(self) -> None:
        """Send the queued reuse reports (one attempt), then close the channel."""
        self._reporter.close()
        if isinstance(self._same_host, SameHostPath):
            self._same_host.close()
        self._same_host = None
        if isinstance(self._staging, PutStaging) and self._owns_staging:
            self._staging.close()
        self._staging = None
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _unary(
        self, method: Callable[..., object], request: object, decode: Callable[..., T]
    ) -> Callable[[float], T]:
        def call(timeout_s: float) -> T:
            return decode(method(request, timeout=timeout_s, metadata=self._metadata))

        return call

    def _idempotent(
        self, operation: str, call: Callable[[float], T], timeout_s: float, miss: T
    ) -> T:
        """`call` retried on transient failures within one deadline; `miss` if it never succeeds."""
        deadline_s = time.monotonic() + timeout_s
        try:
            for attempt in self._timeout_to_retrying[timeout_s].copy():
                with attempt:
                    return call(max(deadline_s - time.monotonic(), MIN_ATTEMPT_TIMEOUT_S))
        except grpc.RpcError as rpc_error:
            return self._settle(operation, rpc_error, miss)
        raise AssertionError("tenacity returned without an attempt")  # pragma: no cover

    def _once(self, operation: str, call: Callable[[float], T], timeout_s: float, miss: T) -> T:
        try:
            return call(timeout_s)
        except grpc.RpcError as rpc_error:
            return self._settle(operation, rpc_error, miss)

    def _settle(self, operation: str, rpc_error: grpc.RpcError, miss: T) -> T:
        """`miss` (with one rate-limited warning) if the store was unreachable; else raise."""
        error = error_from_rpc(rpc_error)
        refused = credential_error(error, self.target, self.namespace)
        if refused is not None:  # one line saying what to do, no gRPC and retry frames
            raise refused from None
        if not isinstance(error, StoreUnavailable):
            raise error from rpc_error
        self.counters.num_degraded_calls += 1
        self._warn_degraded(operation, str(error))
        return miss
