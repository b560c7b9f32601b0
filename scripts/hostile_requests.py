"""Hostile requests for the audit: every RPC aimed at another tenant's namespace, and malformed ones.

Owns what is sent (garbage, damaged and hostile-valued messages, raw frames on any method);
what the sidecar answers is counted by `hostile_audit`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import grpc
from hostile_sidecar import FINGERPRINT, segment

from kvsplice.common.segment import SegmentMeta
from kvsplice.proto import store_pb2 as pb
from kvsplice.server.servicer import SERVICE_NAME
from kvsplice.storeclient.wire import meta_to_header, put_requests


def cross_tenant_calls(stub: Any, victim: SegmentMeta) -> dict[str, Callable[[Any], object]]:
    ns, key = victim.namespace, victim.context_key
    forged_payload = b"attacker bytes" * 100
    forged = segment(ns, victim.token_ids, forged_payload)
    fp = FINGERPRINT
    return {
        "PutSegment": lambda md: stub.PutSegment(put_requests(forged, forged_payload, 4096), metadata=md),
        "GetSegment": lambda md: list(stub.GetSegment(pb.GetSegmentRequest(namespace=ns, context_key=key), metadata=md)),
        "LookupPrefix": lambda md: stub.LookupPrefix(pb.LookupPrefixRequest(namespace=ns, model_fingerprint=fp, token_ids=victim.token_ids), metadata=md),
        "FindSimilar": lambda md: stub.FindSimilar(pb.FindSimilarRequest(namespace=ns, model_fingerprint=fp, token_ids=victim.token_ids), metadata=md),
        "PutAnchor": lambda md: stub.PutAnchor(iter([pb.PutAnchorRequest(namespace=ns, model_fingerprint=fp, placeholder_id="p", anchor_id="a", base_payload=b"x", num_tokens=1)]), metadata=md),
        "GetAnchors": lambda md: list(stub.GetAnchors(pb.GetAnchorsRequest(namespace=ns, model_fingerprint=fp, placeholder_id="p"), metadata=md)),
        "TouchAnchors": lambda md: stub.TouchAnchors(pb.TouchAnchorsRequest(namespace=ns, model_fingerprint=fp, placeholder_id="p", anchor_ids=["a"]), metadata=md),
        "Delete": lambda md: stub.Delete(pb.DeleteRequest(namespace=ns, context_key=key), metadata=md),
        "Stats": lambda md: stub.Stats(pb.StatsRequest(namespace=ns), metadata=md),
        "DescribeDataPlane": lambda md: stub.DescribeDataPlane(pb.DescribeDataPlaneRequest(namespace=ns), metadata=md),
        "ReportReuse": lambda md: stub.ReportReuse(pb.ReportReuseRequest(namespace=ns, num_calls=1, num_prompt_tokens=8), metadata=md),
    }  # fmt: skip


def valid_messages(meta: SegmentMeta, payload: bytes) -> dict[str, list[bytes]]:
    ns, fp, key = meta.namespace, FINGERPRINT, meta.context_key
    put = [pb.PutSegmentRequest(header=meta_to_header(meta)).SerializeToString()]
    put += [pb.PutSegmentRequest(chunk=payload).SerializeToString()]
    return {
        "PutSegment": put,
        "GetSegment": [pb.GetSegmentRequest(namespace=ns, context_key=key).SerializeToString()],
        "LookupPrefix": [pb.LookupPrefixRequest(namespace=ns, model_fingerprint=fp, token_ids=[1, 2, 3]).SerializeToString()],
        "FindSimilar": [pb.FindSimilarRequest(namespace=ns, model_fingerprint=fp, token_ids=[1, 2], text="x", limit=3).SerializeToString()],
        "PutAnchor": [pb.PutAnchorRequest(namespace=ns, model_fingerprint=fp, placeholder_id="p", anchor_id="a", base_payload=b"b" * 64, agent_payloads={"g": b"o"}, num_tokens=4).SerializeToString()],
        "GetAnchors": [pb.GetAnchorsRequest(namespace=ns, model_fingerprint=fp, placeholder_id="p", include_payloads=True).SerializeToString()],
        "TouchAnchors": [pb.TouchAnchorsRequest(namespace=ns, model_fingerprint=fp, placeholder_id="p", anchor_ids=["a"]).SerializeToString()],
        "Delete": [pb.DeleteRequest(namespace=ns, context_key=bytes(16)).SerializeToString()],
        "Stats": [pb.StatsRequest(namespace=ns).SerializeToString()],
        "DescribeDataPlane": [pb.DescribeDataPlaneRequest(namespace=ns).SerializeToString()],
        "ReportReuse": [pb.ReportReuseRequest(namespace=ns, num_calls=1, num_prompt_tokens=8, num_grpc_hit_tokens=4).SerializeToString()],
    }  # fmt: skip


HOSTILE_HEADERS: list[dict[str, Any]] = [
    {"ttl_s": math.nan}, {"ttl_s": math.inf}, {"ttl_s": -5.0}, {"namespace": "team-a\n"},
    {"left_tail_ids": [2**40]}, {"token_ids": [-1]}, {"start_position": 2**62},
    {"layer_start": -3}, {"layer_end": 2**30}, {"payload_nbytes": 2**60}, {"payload_nbytes": -1},
    {"boundary_layers": [2**30]}, {"context_key": b"short"}, {"model_fingerprint": "kvfp1-\u00e9" * 5},
    {"labels": [pb.Label(key="", value="v" * 5000)]}, {"index_text": "\ud7ff" * 100},
]  # fmt: skip


def malformed(
    rng: random.Random, method: str, valid: list[bytes], meta: SegmentMeta
) -> list[bytes]:
    """One malformed request for `method`: garbage, a damaged valid one, or hostile fields."""
    kind = rng.randrange(4)
    first = valid[0]
    if kind == 0:  # raw garbage
        frames = [rng.randbytes(rng.randint(0, 200))]
    elif kind == 1:  # truncated
        frames = [first[: rng.randint(0, max(len(first) - 1, 0))] + b"\x0a\xff\xff\xff\x0f"]
    elif kind == 2:  # bit flips
        data = bytearray(first)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        frames = [bytes(data)]
    else:  # hostile values in a well-formed message
        header = meta_to_header(meta)
        for name, value in rng.choice(HOSTILE_HEADERS).items():
            if isinstance(value, list):
                del getattr(header, name)[:]
                getattr(header, name).extend(value)
            else:
                setattr(header, name, value)
        if method == "PutSegment":
            return [pb.PutSegmentRequest(header=header).SerializeToString(), *valid[1:]]
        frames = [header.SerializeToString()]  # a header where the method wants its request
    return frames + valid[1:] if method == "PutSegment" else frames


def send_raw(channel: grpc.Channel, method: str, frames: list[bytes], md: tuple) -> grpc.StatusCode:  # type: ignore[type-arg]
    path = f"/{SERVICE_NAME}/{method}"
    rpc = pb.DESCRIPTOR.services_by_name["SegmentStore"].methods_by_name[method]
    try:
        if rpc.client_streaming:
            channel.stream_unary(path)(iter(frames), timeout=10, metadata=md)
        elif rpc.server_streaming:
            list(channel.unary_stream(path)(frames[0], timeout=10, metadata=md))
        else:
            channel.unary_unary(path)(frames[0], timeout=10, metadata=md)
    except grpc.RpcError as error:
        return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK
