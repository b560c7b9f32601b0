"""FindSimilar's `with_token_ids` (raw stubs, embedded server): each candidate's tokens and
`exact` flag from the catalog, only when asked, without reading a payload byte."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from helpers.store import FINGERPRINT, NAMESPACE, make_meta, make_payload

from kvsplice.common.keys import off_chain_key, root_key
from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storage.tiered_store import TieredStore
from kvsplice.storeclient.wire import put_requests

TOKENS = list(range(1000, 1032))
ELSEWHERE = off_chain_key(root_key(FINGERPRINT))  # computed after other tokens


@pytest.fixture
def stub(tmp_path: Path) -> Iterator[store_pb2_grpc.SegmentStoreStub]:
    embedded = EmbeddedStore(loopback_config(str(tmp_path / "lmdb")))
    with embedded, grpc.insecure_channel(embedded.target) as channel:
        yield store_pb2_grpc.SegmentStoreStub(channel)


@pytest.fixture
def payload_reads(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The keys whose records the (in-process) sidecar read: every GetSegment goes there."""
    reads: list[bytes] = []
    read = TieredStore._read

    def counted(self: TieredStore, key: bytes, namespace: str, lease: bool) -> object:
        reads.append(key)
        return read(self, key, namespace, lease)

    monkeypatch.setattr(TieredStore, "_read", counted)
    return reads


def similar(stub: store_pb2_grpc.SegmentStoreStub, **fields: object) -> list[pb.SimilarCandidate]:
    request = pb.FindSimilarRequest(
        namespace=NAMESPACE, model_fingerprint=FINGERPRINT, token_ids=TOKENS, **fields
    )
    return list(stub.FindSimilar(request, timeout=10).candidates)


def test_tokens_and_exact_come_only_when_asked_and_no_payload_is_read(
    stub: store_pb2_grpc.SegmentStoreStub, payload_reads: list[bytes]
) -> None:
    exact_payload, other_payload = make_payload(1 << 20, seed=1), make_payload(1 << 20, seed=2)
    exact = make_meta(TOKENS, exact_payload, parent_key=ELSEWHERE, start_position=64, exact=True)
    other = make_meta([*TOKENS[:31], 7], other_payload, parent_key=ELSEWHERE, start_position=8)
    for meta, payload in ((exact, exact_payload), (other, other_payload)):
        stub.PutSegment(put_requests(meta, payload, 64 * 1024), timeout=10)
    (old, old_other) = similar(stub)  # a client older than the field
    assert old.segment.context_key == exact.context_key
    assert old_other.segment.context_key == other.context_key
    for candidate in (old, old_other):
        assert list(candidate.token_ids) == [] and candidate.exact is False
        assert candidate.segment.start_position in (64, 8)
    (asked, asked_other) = similar(stub, with_token_ids=True)
    assert (tuple(asked.token_ids), asked.exact) == (exact.token_ids, True)
    assert (tuple(asked_other.token_ids), asked_other.exact) == (other.token_ids, False)
    # the rest of the answer is what an older client gets
    asked.ClearField("token_ids")
    asked.ClearField("exact")
    assert asked == old
    assert payload_reads == []  # the answers came from the catalog
    # the counter can fail: a GetSegment reads the record
    get = pb.GetSegmentRequest(namespace=NAMESPACE, context_key=exact.context_key)
    assert len(list(stub.GetSegment(get, timeout=10))) > 1
    assert len(payload_reads) == 1


def test_another_namespace_s_segments_are_not_found_with_their_tokens(
    stub: store_pb2_grpc.SegmentStoreStub,
) -> None:
    payload = make_payload(1000)
    meta = make_meta(TOKENS, payload, namespace="tenant-b", exact=True)
    stub.PutSegment(put_requests(meta, payload, 64 * 1024), timeout=10)
    assert similar(stub, with_token_ids=True) == []
    request = pb.FindSimilarRequest(
        namespace="tenant-b", model_fingerprint=FINGERPRINT, token_ids=TOKENS, with_token_ids=True
    )
    (candidate,) = stub.FindSimilar(request, timeout=10).candidates
    assert tuple(candidate.token_ids) == meta.token_ids  # in its own namespace
