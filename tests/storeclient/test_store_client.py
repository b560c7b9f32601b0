"""The sync StoreClient against the embedded server and fake servers: results, server faults
raised as our errors, misses (never failures) when the store is unreachable, slow or corrupt."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
from helpers.store import FINGERPRINT, NAMESPACE, OTHER_FINGERPRINT, make_meta, make_payload
from helpers.store_client import fake_store, refusing_target

from kvsplice.common.errors import FingerprintMismatch, InvalidRequest, Unauthenticated
from kvsplice.proto import store_pb2 as pb
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig
from kvsplice.storeclient.results import PrefixLookup
from kvsplice.storeclient.wire import meta_to_header

FAULT_LOGGER = "kvsplice.storeclient.faults"
# Generous deadlines where a slow shared CI box must not turn answers into misses.
PATIENT = StoreClientConfig(lookup_timeout_s=30.0, get_timeout_s=30.0, put_timeout_s=30.0)
FAST = StoreClientConfig(
    lookup_timeout_s=0.3, get_timeout_s=0.5, put_timeout_s=0.5, warn_interval_s=60.0
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EmbeddedStore]:
    with EmbeddedStore(loopback_config(str(tmp_path), auth_token=None)) as embedded:
        yield embedded


@pytest.fixture
def client(store: EmbeddedStore) -> Iterator[StoreClient]:
    with StoreClient(store.target, NAMESPACE, config=PATIENT) as store_client:
        yield store_client


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == FAULT_LOGGER and r.levelno == logging.WARNING]


def test_put_then_get_by_id_or_key_returns_the_verified_payload(client: StoreClient) -> None:
    payload = make_payload(9 << 20)  # more than two 4 MiB chunks
    meta = make_meta(range(50), payload, index_text="hello world")
    assert client.put_segment(meta, payload) is True
    for segment_id in (meta.segment_id, meta.context_key):
        got = client.get_segment(segment_id, model_fingerprint=FINGERPRINT)
        assert got is not None
        got_meta, got_payload = got
        assert got_payload == payload
        assert replace(got_meta, created_at_s=0.0) == meta


def test_unset_size_and_checksum_are_filled_from_the_payload(client: StoreClient) -> None:
    payload = make_payload(1000)
    meta = replace(make_meta([1, 2], payload), payload_nbytes=0, checksum=0)
    assert client.put_segment(meta, payload) is True
    assert client.get_segment(meta.segment_id)[1] == payload  # type: ignore[index]


def test_a_missing_segment_is_a_quiet_miss(
    client: StoreClient, caplog: pytest.LogCaptureFixture
) -> None:
    assert client.get_segment("00" * 16) is None
    assert warnings_logged(caplog) == []
    assert client.counters.num_degraded_calls == 0


def test_lookups_find_what_was_put(client: StoreClient) -> None:
    payload = make_payload(100)
    meta = make_meta(range(10, 30), payload)
    client.put_segment(meta, payload)
    match = client.lookup_prefix(FINGERPRINT, list(range(10, 40)))
    assert match.num_matched_tokens == 20
    assert [s.segment_id for s in match.segments] == [meta.segment_id]
    (candidate,) = client.find_similar(FINGERPRINT, list(range(10, 30)), parent_key=meta.parent_key)
    assert candidate.exact_tokens and candidate.same_left_context
    assert candidate.segment.segment_id == meta.segment_id
    assert client.lookup_prefix(FINGERPRINT, [999]) == PrefixLookup.MISS


def test_find_similar_returns_tokens_and_exact_only_when_asked(client: StoreClient) -> None:
    payload = make_payload(100)
    meta = make_meta(range(10, 30), payload, exact=True)
    client.put_segment(meta, payload)
    (plain,) = client.find_similar(FINGERPRINT, list(range(10, 30)))
    assert (plain.token_ids, plain.exact) == ((), False)
    (asked,) = client.find_similar(FINGERPRINT, list(range(10, 30)), with_token_ids=True)
    assert (asked.token_ids, asked.exact) == (meta.token_ids, True)
    assert replace(asked, token_ids=(), exact=False) == plain
    other = client.in_namespace("tenant-b")  # another namespace: none of this one's
    assert other.find_similar(FINGERPRINT, list(range(10, 30)), with_token_ids=True) == []


def test_anchors_delete_and_stats(client: StoreClient) -> None:
    assert client.put_anchor(FINGERPRINT, "question", "a1", b"base", {"critic": b"off"}, 7) == []
    assert client.touch_anchors(FINGERPRINT, "question", ["a1", "nope"]) == 1
    (anchor,) = client.get_anchors(FINGERPRINT, "question")
    assert (anchor.anchor_id, anchor.activation_count, anchor.base_payload) == ("a1", 1, b"base")
    assert dict(anchor.agent_payloads) == {"critic": b"off"}
    assert anchor.agent_ids == ("critic",)
    (only,) = client.get_anchors(FINGERPRINT, "question", anchor_ids=["a1"], agent_id="judge")
    assert (only.base_payload, dict(only.agent_payloads)) == (b"base", {})
    payload = make_payload(100)
    meta = make_meta([1, 2, 3], payload)
    client.put_segment(meta, payload)
    stats = client.stats()
    assert stats is not None and stats.num_segments == 1
    assert client.delete(meta.segment_id) is True
    assert client.delete(meta.segment_id) is False
    assert client.stats().num_segments == 0  # type: ignore[union-attr]


def test_server_faults_raise_our_errors(client: StoreClient) -> None:
    payload = make_payload(100)
    meta = make_meta([1, 2, 3], payload)
    client.put_segment(meta, payload)
    with pytest.raises(FingerprintMismatch):
        client.get_segment(meta.segment_id, model_fingerprint=OTHER_FINGERPRINT)
    with pytest.raises(InvalidRequest):
        client.lookup_prefix(FINGERPRINT, [1, -5])
    with pytest.raises(InvalidRequest):
        client.put_segment(make_meta([1], payload, namespace="tenant-b"), payload)  # not ours
    with pytest.raises(InvalidRequest):
        client.get_segment("not hex")
    with pytest.raises(InvalidRequest):
        StoreClient("127.0.0.1:1", "bad namespace")


def test_a_token_protected_store_refuses_clients_without_it(tmp_path: Path) -> None:
    with EmbeddedStore(loopback_config(str(tmp_path), auth_token="tok")) as embedded:
        with (
            StoreClient(embedded.target, NAMESPACE, config=PATIENT) as anonymous,
            pytest.raises(Unauthenticated),
        ):
            anonymous.lookup_prefix(FINGERPRINT, [1])
        with StoreClient(embedded.target, NAMESPACE, token="tok", config=PATIENT) as bearer:
            assert bearer.lookup_prefix(FINGERPRINT, [1]) == PrefixLookup.MISS


@pytest.mark.timeout(120)  # a hang guard only: the calls give up, they are not timed
def test_unreachable_store_gives_misses_and_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    payload = make_payload(100)
    meta = make_meta([1, 2], payload)
    with (
        refusing_target() as target,
        StoreClient(target, NAMESPACE, config=FAST) as client,
    ):
        results = [
            client.put_segment(meta, payload),
            client.get_segment(meta.segment_id),
            client.lookup_prefix(FINGERPRINT, [1, 2]),
            client.find_similar(FINGERPRINT, [1, 2]),
            client.put_anchor(FINGERPRINT, "p", "a", b"x", {}, 1),
            client.get_anchors(FINGERPRINT, "p"),
            client.touch_anchors(FINGERPRINT, "p", ["a"]),
            client.delete(meta.segment_id),
            client.stats(),
        ]
    assert results == [False, None, PrefixLookup.MISS, [], None, [], 0, False, None]
    assert client.counters.num_degraded_calls == 9
    assert len(warnings_logged(caplog)) == 1


def test_clients_of_one_dead_store_share_one_warning_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with refusing_target() as target:
        for _ in range(4):  # a demo opens one client per mode and agent
            with StoreClient(target, NAMESPACE, config=FAST) as client:
                assert client.lookup_prefix(FINGERPRINT, [1, 2]) == PrefixLookup.MISS
    assert len(warnings_logged(caplog)) == 1


def test_a_new_client_never_inherits_the_refused_connection_of_an_old_one() -> None:
    """The cause of a flake: an engine's client, never closed, kept reporting to its
    module's store after it stopped; a fake store of a later test got that port, and a
    new client there was told "connection refused" from the old client's backoff."""
    slow_retry = replace(FAST, reconnect_backoff_ms=60_000, max_reconnect_backoff_ms=60_000)
    lookup = ("unary", lambda request, context: pb.LookupPrefixResponse())
    with (
        refusing_target(shareable=True) as target,
        StoreClient(target, NAMESPACE, config=slow_retry) as old,
    ):
        assert old.lookup_prefix(FINGERPRINT, [1, 2]) == PrefixLookup.MISS  # refused
        assert old.counters.num_degraded_calls == 1
        with (
            fake_store(target, LookupPrefix=lookup),
            StoreClient(target, NAMESPACE, config=slow_retry) as new,
        ):
            assert new.lookup_prefix(FINGERPRINT, [1, 2]) == PrefixLookup.MISS  # answered
            assert new.counters.num_degraded_calls == 0


def test_a_store_slower_than_the_deadline_is_a_miss() -> None:
    answer = threading.Event()  # set only once the client has returned

    def slow_lookup(
        request: pb.LookupPrefixRequest, context: grpc.ServicerContext
    ) -> pb.LookupPrefixResponse:
        answer.wait(30)
        return pb.LookupPrefixResponse(num_matched_tokens=1)

    with (
        fake_store(LookupPrefix=("unary", slow_lookup)) as target,
        StoreClient(target, NAMESPACE, config=FAST) as client,
    ):
        try:  # the store cannot answer before the client gave up: only its deadline ends it
            assert client.lookup_prefix(FINGERPRINT, [1]) == PrefixLookup.MISS
        finally:
            answer.set()
        assert client.counters.num_degraded_calls == 1


def test_idempotent_calls_are_retried_on_unavailable() -> None:
    attempts: list[int] = []

    def flaky_stats(request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        attempts.append(1)
        if len(attempts) < 3:
            context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")
        return pb.StatsResponse(num_segments=4)

    config = replace(FAST, lookup_timeout_s=2.0)
    with (
        fake_store(Stats=("unary", flaky_stats)) as target,
        StoreClient(target, NAMESPACE, config=config) as client,
    ):
        stats = client.stats()
    assert stats is not None and stats.num_segments == 4
    assert len(attempts) == 3


def test_puts_are_not_retried() -> None:
    attempts: list[int] = []

    def unavailable_put(
        requests: Iterator[pb.PutSegmentRequest], context: grpc.ServicerContext
    ) -> pb.PutSegmentResponse:
        attempts.append(1)
        context.abort(grpc.StatusCode.UNAVAILABLE, "down")
        return pb.PutSegmentResponse()

    payload = make_payload(10)
    with (
        fake_store(PutSegment=("client_stream", unavailable_put)) as target,
        StoreClient(target, NAMESPACE, config=FAST) as client,
    ):
        assert client.put_segment(make_meta([1], payload), payload) is False
    assert len(attempts) == 1


def test_a_payload_failing_its_checksum_is_a_counted_miss(caplog: pytest.LogCaptureFixture) -> None:
    payload = make_payload(1000)
    header = meta_to_header(make_meta([1, 2], payload))

    def tampered_get(
        request: pb.GetSegmentRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GetSegmentResponse]:
        yield pb.GetSegmentResponse(header=header)
        yield pb.GetSegmentResponse(chunk=payload[:-1] + b"\x00")

    with (
        fake_store(GetSegment=("server_stream", tampered_get)) as target,
        StoreClient(target, NAMESPACE, config=FAST) as client,
    ):
        assert client.get_segment("00" * 16) is None
        assert client.counters.num_corrupt_payloads == 1
    assert len(warnings_logged(caplog)) == 1


def test_sixteen_concurrent_clients_never_mix_up_payloads(store: EmbeddedStore) -> None:
    errors: list[BaseException] = []
    metas = {}

    def worker(worker_id: int) -> None:
        try:
            with StoreClient(store.target, NAMESPACE, config=PATIENT) as client:
                for round_id in range(4):
                    payload = make_payload(
                        16_384 + 4096 * worker_id + round_id, seed=worker_id * 100 + round_id
                    )
                    tokens = [worker_id * 1000 + round_id * 10 + i for i in range(8)]
                    meta = make_meta(tokens, payload)
                    metas[meta.segment_id] = payload
                    assert client.put_segment(meta, payload) is True
                    got = client.get_segment(meta.segment_id)
                    assert got is not None and got[1] == payload
                    match = client.lookup_prefix(FINGERPRINT, tokens)
                    assert [s.segment_id for s in match.segments] == [meta.segment_id]
                assert client.counters.num_degraded_calls == 0
        except BaseException as error:  # collected, asserted below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    with StoreClient(store.target, NAMESPACE, config=PATIENT) as client:
        for segment_id, payload in metas.items():
            assert client.get_segment(segment_id)[1] == payload  # type: ignore[index]
    assert len(metas) == 64


def test_the_store_client_does_not_import_torch() -> None:
    code = "import sys, kvsplice.storeclient.client; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_clients_of_other_namespaces_share_one_channel_and_stay_apart(
    client: StoreClient,
) -> None:
    other = client.in_namespace("other-team")
    payload = make_payload(4096)
    meta = replace(make_meta(range(20), payload), namespace="other-team")
    assert other.put_segment(meta, payload) is True
    assert other.get_segment(meta.segment_id) is not None
    assert client.get_segment(meta.segment_id) is None  # another namespace: not visible
    assert other._channel is client._channel  # no connection of its own
    other.close()
    assert client.lookup_prefix(FINGERPRINT, list(range(20))) is not None  # still open
