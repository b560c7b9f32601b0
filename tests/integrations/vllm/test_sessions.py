"""The connector reads a request's session from vLLM's own `Request` (built as the engine core
builds it: an `EngineCoreRequest` through vLLM's msgpack codec, then `from_engine_core_request`):
`session_id` goes with its lookups and puts, a `retain` hint's lease is renewed (the sidecar's
outcome logged), a `release` hint ends the session when the request finishes, and malformed
hints are rejected and logged. Against a real embedded sidecar."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.store import FINGERPRINT, NAMESPACE, make_chain
from helpers.waiting import wait_for
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.request import Request
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from kvsplice.integrations.vllm import sessions
from kvsplice.integrations.vllm.connector_config import ConnectorConfig
from kvsplice.integrations.vllm.scheduler_side import SchedulerSide
from kvsplice.integrations.vllm.sessions import SessionScope, session_scope
from kvsplice.integrations.vllm.store_clients import StoreClients
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storage.config import SessionConfig
from kvsplice.storeclient.client import StoreClient

BLOCK = 4
TOKENS = list(range(100, 117))  # 4 whole blocks stored, one token to compute


def make_request(
    request_id: str, session_id: str | None = None, *actions: KvHintAction, version: str = "1"
) -> Request:
    """A `Request` as vLLM's engine core receives and builds it."""
    hints = KvHintsEnvelope(version, f"m-{request_id}", list(actions)) if actions else None
    core = EngineCoreRequest(
        request_id=request_id, prompt_token_ids=TOKENS, mm_features=None,
        sampling_params=SamplingParams(max_tokens=1), pooling_params=None, arrival_time=0.0,
        lora_request=None, cache_salt=None, data_parallel_rank=None,
        session_id=session_id, kv_hints=hints,
    )  # fmt: skip
    received = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(core))
    return Request.from_engine_core_request(received, block_hasher=None)


def retain(lease_s: object) -> KvHintAction:
    return KvHintAction("a-retain", "retain", "1", {"lease_s": lease_s})


RELEASE = KvHintAction("a-release", "release", "1", {})


@pytest.fixture(autouse=True)
def fresh_log() -> None:
    sessions._log.clear()


@pytest.fixture
def sidecar(tmp_path: Path):
    config = loopback_config(str(tmp_path / "db"))
    store = replace(config.store, sessions=SessionConfig(lease_s=60.0, max_lease_s=120.0))
    with EmbeddedStore(replace(config, store=store)) as embedded:
        with StoreClient(embedded.target, NAMESPACE) as client:
            spans = [TOKENS[i : i + BLOCK] for i in range(0, 16, BLOCK)]
            for meta, payload in make_chain(spans):
                assert client.put_segment(meta, payload)
        yield embedded


@pytest.fixture
def side(sidecar):
    clients = StoreClients(ConnectorConfig(sidecar.target, namespace=NAMESPACE))
    yield SchedulerSide(clients, FINGERPRINT, BLOCK, BLOCK, lookup_wait_s=10.0)
    clients.close()


def test_a_request_s_session_and_hints_are_read_from_vllm_s_request() -> None:
    assert session_scope(make_request("r0")) is None
    assert session_scope(make_request("r1", "task-1")) == SessionScope("task-1")
    scope = session_scope(make_request("r2", "task-1", retain(30), RELEASE))
    assert scope == SessionScope("task-1", lease_s=30.0, release=True)


def test_a_session_s_lookup_holds_what_it_matched_and_its_release_ends_it(sidecar, side) -> None:
    live = sidecar.server.store.sessions
    request = make_request("r1", "task-1")
    assert side.num_new_matched_tokens(request, 0) == 16
    assert live.num_live() == 1 and live.held_nbytes(NAMESPACE) > 0
    assert side._tracked["r1"].saves.session_id == "task-1"  # its puts carry it too
    side.finished(request)
    assert live.num_live() == 1  # no release hint: held until the lease runs out
    last = make_request("r2", "task-1", RELEASE)
    assert side.num_new_matched_tokens(last, 0) == 16
    assert side._tracked["r2"].saves.session_id == ""  # a released session's puts: not held
    side.finished(last)
    wait_for(live.num_live, lambda n: n == 0, timeout_s=5.0)
    assert live.held_nbytes(NAMESPACE) == 0


def test_without_a_session_id_nothing_is_held(sidecar, side) -> None:
    request = make_request("r1")
    assert side.num_new_matched_tokens(request, 0) == 16
    assert sidecar.server.store.sessions.num_live() == 0
    assert side._tracked["r1"].saves.session_id == ""


def test_a_retain_beyond_the_sidecar_s_max_lease_is_clipped_and_logged(side, caplog) -> None:
    caplog.set_level(logging.INFO, logger=sessions.__name__)
    assert side.num_new_matched_tokens(make_request("r1", "task-1", retain(30.0)), 0) == 16
    assert side.num_new_matched_tokens(make_request("r2", "task-2", retain(900.0)), 0) == 16
    text = caplog.text
    assert "task-1 (lease 30.0 s): accepted, 30 s" in text
    assert "task-2 (lease 900.0 s): clipped, 120 s" in text


@pytest.mark.parametrize(
    ("request_args", "why"),
    [
        (("r1", None, RELEASE), "names no session_id"),
        (("r1", "s", KvHintAction("a", "pin", "1", {})), "action_type 'pin'"),
        (("r1", "s", KvHintAction("a", "retain", "2", {})), "action_version '2'"),
        (("r1", "s", retain(-1)), "lease_s -1 is not"),
        (("r1", "s", retain("long")), "lease_s 'long' is not"),
    ],
)
def test_malformed_hints_are_rejected_and_logged(request_args, why, caplog) -> None:
    caplog.set_level(logging.INFO, logger=sessions.__name__)
    scope = session_scope(make_request(*request_args))
    assert scope is None or (scope.lease_s, scope.release) == (None, False)
    assert "rejected" in caplog.text and why in caplog.text


def test_a_hints_envelope_of_another_protocol_version_is_rejected(caplog) -> None:
    caplog.set_level(logging.INFO, logger=sessions.__name__)
    scope = session_scope(make_request("r1", "s", RELEASE, version="2"))
    assert scope == SessionScope("s")
    assert "rejected: protocol_version '2'" in caplog.text
