"""Reuse reports: what engines reused reaches the sidecar's stats, split by where it was
served (the local tier's hit keys, the client's read path); the reporter's batching and retention."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from helpers.client import make_loaded
from helpers.text import make_prompt

from kvsplice.client.execute.execution import GenerationConfig
from kvsplice.client.model.models import LoadedModel
from kvsplice.client.reuse_engine import CallOutcome, EngineConfig, ReuseEngine
from kvsplice.common.errors import InvalidRequest
from kvsplice.common.reuse_report import ReusedRun, ReuseReport, ReuseReporter, call_report
from kvsplice.proto import store_pb2 as pb
from kvsplice.server import convert
from kvsplice.server.sidecar_process import SidecarProcess, SidecarSpec
from kvsplice.storeclient import wire as store_wire
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import StoreClientConfig

NAMESPACE = "reports"
GENERATION = GenerationConfig(max_new_tokens=3, stop_token_ids=(127,))
PROMPT = make_prompt(
    [
        ("text", "system", "<|im_start|>system\nYou add numbers.<|im_end|>\n"),
        ("text", "user", "<|im_start|>user\nwhat is two plus two?<|im_end|>\n"),
    ]
)
PATIENT = StoreClientConfig(lookup_timeout_s=10.0, get_timeout_s=30.0, put_timeout_s=30.0)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    path = tmp_path_factory.mktemp("reports") / "lmdb"
    with SidecarProcess(SidecarSpec(str(path), map_size_bytes=64 << 20)) as process:
        yield process


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return make_loaded()


def run_calls(loaded: LoadedModel, client: StoreClient, num_calls: int) -> list[CallOutcome]:
    with ReuseEngine(loaded, "exact", client, EngineConfig(quant="none")) as engine:
        outcomes = [engine.run(PROMPT, GENERATION) for _ in range(num_calls)]
    return outcomes


def test_sidecar_counts_what_engines_reused_by_where_it_was_served(
    loaded: LoadedModel, sidecar: SidecarProcess
) -> None:
    over_grpc = replace(PATIENT, same_host_reads=False)
    with StoreClient(sidecar.target, NAMESPACE, config=PATIENT) as writer:
        (first,) = run_calls(loaded, writer, 1)  # computes and stores the prompt
    with StoreClient(sidecar.target, NAMESPACE, config=PATIENT) as same_host:
        in_place, local = run_calls(loaded, same_host, 2)  # read in place, then locally
        assert same_host.counters.num_same_host_reads > 0
    with StoreClient(sidecar.target, NAMESPACE, config=over_grpc) as remote:
        (grpc_call,) = run_calls(loaded, remote, 1)
    with StoreClient(sidecar.target, NAMESPACE, config=PATIENT) as reader:
        stats = reader.stats()  # every client above sent its reports when it closed
    assert first.num_reused_tokens == 0
    assert in_place.num_reused_tokens == local.num_reused_tokens == grpc_call.num_reused_tokens > 0
    assert stats is not None and stats.num_calls == 4
    assert stats.num_prompt_tokens == 4 * first.num_prompt_tokens
    assert dict(stats.hit_tokens) == {
        "local": local.num_reused_tokens,
        "in_place": in_place.num_reused_tokens,
        "grpc": grpc_call.num_reused_tokens,
    }
    assert stats.num_approximate_hit_tokens == 0  # exact reuse only


def test_reporter_merges_reports_and_keeps_what_the_store_could_not_take() -> None:
    sent: list[ReuseReport] = []
    reachable = [False]

    def send(report: ReuseReport) -> bool:
        if reachable[0]:
            sent.append(report)
        return reachable[0]

    reporter = ReuseReporter(send, interval_s=3600.0)  # flushed by hand only
    key = bytes(range(16))
    reporter.add(call_report(10, [ReusedRun(6, "local", key)]))
    assert not reporter.flush() and sent == []  # unreachable: kept
    moved = ReusedRun(3, "in_place", key, exact=False)  # computed after another prefix
    reporter.add(call_report(8, [ReusedRun(4, "in_place", key), ReusedRun(1, "grpc", key), moved]))
    reachable[0] = True
    reporter.close()
    (report,) = sent
    assert (report.num_calls, report.num_prompt_tokens) == (2, 18)
    assert dict(report.hit_tokens) == {"local": 6, "in_place": 7, "grpc": 1}
    assert (report.num_approximate_hit_tokens, report.num_exact_hit_tokens) == (3, 11)
    # gRPC reads are counted where they are served: only unseen reads travel per segment
    assert dict(report.segment_reads) == {(key, "local"): 1, (key, "in_place"): 2}
    assert report.hit_rate == pytest.approx(14 / 18)


def test_a_report_never_claims_more_reuse_than_prompt_tokens() -> None:
    with pytest.raises(ValueError, match="reused tokens"):
        call_report(4, [ReusedRun(5, "local")])
    with pytest.raises(ValueError, match="served"):
        ReuseReport(1, 4, {"disk": 1})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="approximate"):
        ReuseReport(1, 4, {"local": 2}, num_approximate_hit_tokens=3)  # more than reused


def test_an_approximate_report_travels_apart_and_an_old_clients_counts_as_exact() -> None:
    key = bytes(range(16))
    runs = [ReusedRun(2, "grpc", key), ReusedRun(5, "in_place", key, exact=False)]
    sent = call_report(9, runs)
    received = convert.reuse_report(store_wire.report_request(NAMESPACE, sent))
    assert (received.num_hit_tokens, received.num_approximate_hit_tokens) == (7, 5)
    old = store_wire.report_request(NAMESPACE, sent)
    old.ClearField("num_approximate_hit_tokens")  # what a client before the field sends
    received = convert.reuse_report(pb.ReportReuseRequest.FromString(old.SerializeToString()))
    assert (received.num_approximate_hit_tokens, received.num_exact_hit_tokens) == (0, 7)
    bad = store_wire.report_request(NAMESPACE, sent)
    bad.num_approximate_hit_tokens = 8  # more than the 7 reused
    with pytest.raises(InvalidRequest, match="approximate"):
        convert.reuse_report(bad)


def test_store_client_sends_reports_in_the_background(sidecar: SidecarProcess) -> None:
    config = replace(PATIENT, report_interval_s=0.05)
    with StoreClient(sidecar.target, "reports-bg", config=config) as client:
        client.report_reuse(7, [ReusedRun(7, "local")])
        for _ in range(400):  # up to ~20 s on a loaded host; no flush called here
            stats = client.stats()
            if stats is not None and stats.num_calls:
                break
            time.sleep(0.05)
        assert stats is not None and (stats.num_calls, stats.num_prompt_tokens) == (1, 7)
        assert stats.hit_rate == 1.0
