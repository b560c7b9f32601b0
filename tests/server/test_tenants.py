"""Tenants: the file format, patterns, roles, constant-time lookup and SIGHUP-style reload;
then two tenants against a real store: every RPC and admin endpoint aimed at the other
tenant's namespace is refused and its data stays intact."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from helpers.scripts import load_script
from helpers.store import FINGERPRINT, make_meta, make_payload

from kvsplice.common.errors import PermissionDenied, Unauthenticated
from kvsplice.common.staging import new_name
from kvsplice.proto import store_pb2 as pb
from kvsplice.proto import store_pb2_grpc
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.server.tenants import Authenticator, Tenant, TenantTable, token_sha256
from kvsplice.storeclient.wire import put_requests, staged_put_request

TOKENS = {"alice": "tok-alice", "bob": "tok-bob", "reader": "tok-reader", "root": "tok-root"}


def write_tenants(path: Path) -> Path:
    entries = [
        {"name": "alice", "namespaces": ["team-a"], "role": "writer"},
        {"name": "bob", "namespaces": ["team-b", "bob-*"], "role": "writer"},
        {"name": "reader", "namespaces": ["team-a"], "role": "reader"},
        {"name": "root", "namespaces": [], "role": "admin"},
    ]
    for entry in entries:
        entry["token_sha256"] = token_sha256(TOKENS[str(entry["name"])])
    path.write_text(json.dumps({"tenants": entries}))
    return path


# -- the file and the checks ----------------------------------------------------------


def test_patterns_roles_and_admin() -> None:
    bob = Tenant("bob", "a" * 64, ("team-b", "bob-*"), "writer")
    assert bob.may_use("team-b") and bob.may_use("bob-1") and bob.may_use("bob-")
    assert not bob.may_use("team-a") and not bob.may_use("team-b2") and not bob.may_use("bo")
    assert Tenant("root", "b" * 64, (), "admin").may_use("anything")
    assert not Tenant("r", "c" * 64, ("x",), "reader").can_write


@pytest.mark.parametrize(
    "pattern, covered, not_covered",
    [
        (
            "team-a*",
            ["team-a", "team-a.salt-0123456789abcdef", "team-a:planner", "team-a.x.y"],
            ["team-admin", "team-ab", "team-a-b", "team-a_b", "team-", "team", "xteam-a"],
        ),
        ("team-a-*", ["team-a-planner", "team-a-"], ["team-a", "team-admin", "team-a.x"]),
        ("team-a.*", ["team-a.salt-00ff", "team-a."], ["team-a", "team-ab", "team-a:x"]),
        ("team-a", ["team-a"], ["team-a.salt-00ff", "team-ab", "team-a-b"]),
        ("*", ["team-a", "x", "team-admin"], []),
    ],
)
def test_a_pattern_matches_only_at_a_separator(
    pattern: str, covered: list[str], not_covered: list[str]
) -> None:
    tenant = Tenant("t", "d" * 64, (pattern,), "writer")
    assert [ns for ns in covered if not tenant.may_use(ns)] == []
    assert [ns for ns in not_covered if tenant.may_use(ns)] == []


def test_the_grant_for_salted_namespaces_covers_the_connectors_salts_only() -> None:
    """`team-a*` is the grant docs give an engine: its own salted namespaces, no neighbour's."""
    engine = Tenant("engine", "e" * 64, ("team-a*",), "writer")
    auth = Authenticator()
    auth.authorize(engine, "team-a.salt-5f3c0d9e8a7b6c41", write=True)
    for neighbour in ("team-admin", "team-ab", "team-admin.salt-5f3c0d9e8a7b6c41"):
        with pytest.raises(PermissionDenied, match=neighbour):
            auth.authorize(engine, neighbour)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"name": "a", "token_sha256": "A" * 64, "namespaces": ["x"], "role": "writer"}, "hex"),
        ({"name": "a", "token_sha256": "a" * 64, "namespaces": ["x"], "role": "owner"}, "role"),
        ({"name": "a", "token_sha256": "a" * 64, "namespaces": ["x\n"], "role": "reader"}, "x"),
        ({"name": "a", "token_sha256": "a" * 64, "namespaces": [], "role": "reader"}, "names no"),
        ({"name": "a", "token": "secret", "namespaces": ["x"], "role": "reader"}, "exactly"),
    ],
)
def test_bad_tenant_entries_are_refused_naming_the_problem(
    entry: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TenantTable.parse(json.dumps({"tenants": [entry]}))


def test_a_plain_token_put_in_the_file_by_mistake_never_reaches_an_error_message() -> None:
    entry = {"name": "a", "token": "s3cret-plain", "namespaces": ["x"], "role": "reader"}
    with pytest.raises(ValueError) as caught:
        TenantTable.parse(json.dumps({"tenants": [entry]}))
    assert "s3cret-plain" not in str(caught.value)


def test_tokens_are_found_by_hash_only(tmp_path: Path) -> None:
    path = write_tenants(tmp_path / "tenants.json")
    text = path.read_text()
    assert not any(token in text for token in TOKENS.values())
    auth = Authenticator(path)
    assert auth.authenticate("Bearer tok-bob").name == "bob"
    for bad in (None, "", "Bearer", "Bearer tok-bo", "tok-bob", "Basic tok-bob"):
        with pytest.raises(Unauthenticated):
            auth.authenticate(bad)


def test_authorize_refuses_other_namespaces_and_readers_writing(tmp_path: Path) -> None:
    auth = Authenticator(write_tenants(tmp_path / "tenants.json"))
    alice, reader = auth.authenticate("Bearer tok-alice"), auth.authenticate("Bearer tok-reader")
    auth.authorize(alice, "team-a", write=True)
    auth.authorize(reader, "team-a")
    with pytest.raises(PermissionDenied):
        auth.authorize(alice, "team-b")
    with pytest.raises(PermissionDenied):
        auth.authorize(reader, "team-a", write=True)


def test_reload_picks_up_new_tenants_and_keeps_the_old_on_a_bad_file(tmp_path: Path) -> None:
    path = write_tenants(tmp_path / "tenants.json")
    auth = Authenticator(path, admin_token="tok-admin")
    table = TenantTable.load(path).with_tenant(Tenant("carol", token_sha256("c"), ("c",), "reader"))
    path.write_text(table.dumps())
    with pytest.raises(Unauthenticated):
        auth.authenticate("Bearer c")
    assert auth.reload() and auth.authenticate("Bearer c").name == "carol"
    path.write_text("{not json")
    assert not auth.reload()
    assert auth.authenticate("Bearer c").name == "carol"
    assert auth.authenticate("Bearer tok-admin").is_admin


# -- two tenants against a running store -------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[EmbeddedStore]:
    config = loopback_config(
        str(tmp_path / "lmdb"), tenants_path=str(write_tenants(tmp_path / "t.json")), admin_port=0
    )
    with EmbeddedStore(config) as embedded:
        yield embedded


def metadata(name: str | None) -> tuple[tuple[str, str], ...]:
    return () if name is None else (("authorization", f"Bearer {TOKENS[name]}"),)


def rpc_calls(
    key: bytes, ns: str
) -> dict[str, Callable[[store_pb2_grpc.SegmentStoreStub, tuple], object]]:  # type: ignore[type-arg]
    """One call of every RPC of the service aimed at namespace `ns`."""
    payload = make_payload(1000, seed=7)
    meta = make_meta([7, 7, 7], payload, namespace=ns)
    return {
        "PutSegment": lambda s, md: s.PutSegment(put_requests(meta, payload, 4096), metadata=md),
        "PutStagedSegment": lambda s, md: s.PutStagedSegment(
            staged_put_request(meta, new_name(), 0), metadata=md
        ),
        "GetSegment": lambda s, md: list(
            s.GetSegment(pb.GetSegmentRequest(namespace=ns, context_key=key), metadata=md)
        ),
        "LookupPrefix": lambda s, md: s.LookupPrefix(
            pb.LookupPrefixRequest(namespace=ns, model_fingerprint=FINGERPRINT, token_ids=[1, 2]),
            metadata=md,
        ),
        "FindSimilar": lambda s, md: s.FindSimilar(
            pb.FindSimilarRequest(
                namespace=ns, model_fingerprint=FINGERPRINT, token_ids=[1, 2], with_token_ids=True
            ),
            metadata=md,
        ),
        "PutAnchor": lambda s, md: s.PutAnchor(
            iter(
                [
                    pb.PutAnchorRequest(
                        namespace=ns,
                        model_fingerprint=FINGERPRINT,
                        placeholder_id="p",
                        anchor_id="a",
                        base_payload=b"x",
                        num_tokens=1,
                    )
                ]
            ),
            metadata=md,
        ),
        "GetAnchors": lambda s, md: list(
            s.GetAnchors(
                pb.GetAnchorsRequest(
                    namespace=ns, model_fingerprint=FINGERPRINT, placeholder_id="p"
                ),
                metadata=md,
            )
        ),
        "TouchAnchors": lambda s, md: s.TouchAnchors(
            pb.TouchAnchorsRequest(
                namespace=ns, model_fingerprint=FINGERPRINT, placeholder_id="p", anchor_ids=["a"]
            ),
            metadata=md,
        ),
        "Delete": lambda s, md: s.Delete(
            pb.DeleteRequest(namespace=ns, context_key=key), metadata=md
        ),
        "Stats": lambda s, md: s.Stats(pb.StatsRequest(namespace=ns), metadata=md),
        "DescribeDataPlane": lambda s, md: s.DescribeDataPlane(
            pb.DescribeDataPlaneRequest(namespace=ns), metadata=md
        ),
        "ReportReuse": lambda s, md: s.ReportReuse(
            pb.ReportReuseRequest(
                namespace=ns, num_calls=1, num_prompt_tokens=10, num_local_hit_tokens=10
            ),
            metadata=md,
        ),
        "RenewSession": lambda s, md: s.RenewSession(
            pb.SessionRenewRequest(namespace=ns, session_id="s"), metadata=md
        ),
        "EndSession": lambda s, md: s.EndSession(
            pb.SessionEndRequest(namespace=ns, session_id="s"), metadata=md
        ),
    }


# the status a call ends with: the hostile audit's own reading of it
code_of = load_script("hostile_sidecar").code_of


def test_every_rpc_aimed_at_another_tenant_is_refused(store: EmbeddedStore) -> None:
    payload = make_payload(50_000)
    meta = make_meta([1, 2], payload, namespace="team-b")
    with grpc.insecure_channel(store.target) as channel:
        stub = store_pb2_grpc.SegmentStoreStub(channel)
        stub.PutSegment(put_requests(meta, payload, 4096), metadata=metadata("bob"))
        calls = rpc_calls(meta.context_key, "team-b")
        assert set(calls) == {
            m.name for m in pb.DESCRIPTOR.services_by_name["SegmentStore"].methods
        }
        for name, call in calls.items():
            code = code_of(lambda c=call: c(stub, metadata("alice")))  # type: ignore[misc]
            assert code is grpc.StatusCode.PERMISSION_DENIED, name
            assert code_of(lambda c=call: c(stub, ())) is grpc.StatusCode.UNAUTHENTICATED, name  # type: ignore[misc]
        reader_calls = rpc_calls(meta.context_key, "team-a")
        for name in (
            "PutSegment",
            "PutStagedSegment",
            "PutAnchor",
            "Delete",
            "ReportReuse",
            "RenewSession",
            "EndSession",
        ):
            code = code_of(lambda c=reader_calls[name]: c(stub, metadata("reader")))  # type: ignore[misc]
            assert code is grpc.StatusCode.PERMISSION_DENIED, name
        # bob's segment is intact; bob and the admin read it.
        for reader in ("bob", "root"):
            request = pb.GetSegmentRequest(namespace="team-b", context_key=meta.context_key)
            replies = list(stub.GetSegment(request, metadata=metadata(reader)))
            assert b"".join(r.chunk for r in replies[1:]) == payload


def test_every_admin_endpoint_aimed_at_another_tenant_is_refused(store: EmbeddedStore) -> None:
    assert store._server is not None and store._server.admin is not None
    base = f"http://127.0.0.1:{store._server.admin.port}"

    def get(path: str, name: str | None) -> httpx.Response:
        headers = dict(metadata(name)) if name else {}
        return httpx.get(base + path, headers=headers, timeout=5)

    for path in ("/v1/stats?namespace=team-b", "/v1/segments?namespace=team-b", "/metrics"):
        assert get(path, "alice").status_code == 403, path
        assert get(path, None).status_code == 401, path
    assert get("/openapi.json", None).status_code == 401
    assert get("/openapi.json", "alice").json()["info"]["title"] == "kvsplice admin"
    with grpc.insecure_channel(store.target) as channel:
        stub = store_pb2_grpc.SegmentStoreStub(channel)
        for ns, name in (("team-a", "alice"), ("team-b", "bob")):
            payload = make_payload(100)
            stub.PutSegment(
                put_requests(make_meta([3], payload, namespace=ns), payload, 4096),
                metadata=metadata(name),
            )
    assert [r["namespace"] for r in get("/v1/stats", "alice").json()["namespaces"]] == ["team-a"]
    assert {r["namespace"] for r in get("/v1/stats", "root").json()["namespaces"]} == {
        "team-a", "team-b"
    }  # fmt: skip
    assert get("/metrics", "root").status_code == 200
    assert get("/healthz", None).status_code == 200


@pytest.mark.slow
def test_tenants_add_prints_a_token_once_and_sighup_admits_it(tmp_path: Path) -> None:
    import signal
    import subprocess

    from helpers.serve_process import KVSPLICE, start_serve

    tenants = tmp_path / "tenants.json"

    def add(name: str, namespace: str) -> str:
        command = [
            *KVSPLICE,
            "tenants",
            "add",
            name,
            "--namespace",
            namespace,
            "--file",
            str(tenants),
        ]
        return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()

    first = add("alice", "team-a")
    lmdb = ["--lmdb-path", str(tmp_path / "lmdb")]
    sidecar = start_serve(tmp_path / "sidecar", *lmdb, "--tenants", str(tenants), admin=False)
    try:
        second = add("bob", "team-b")
        assert first not in tenants.read_text() and second not in tenants.read_text()
        with grpc.insecure_channel(sidecar.target) as channel:
            stub = store_pb2_grpc.SegmentStoreStub(channel)

            def stats(token: str) -> grpc.StatusCode:
                request = pb.StatsRequest(namespace="team-b")
                md = (("authorization", f"Bearer {token}"),)
                return code_of(lambda: stub.Stats(request, metadata=md))

            assert stats(second) is grpc.StatusCode.UNAUTHENTICATED
            sidecar.process.send_signal(signal.SIGHUP)
            # NOTE: a wait for the reload, not a timing claim: no deadline of our own (a loaded
            # 2-core host can take long); pytest's timeout fails a reload that never comes
            while stats(second) is not grpc.StatusCode.OK:
                time.sleep(0.1)
            assert stats(second) is grpc.StatusCode.OK, "SIGHUP did not reload the tenants file"
            assert stats(first) is grpc.StatusCode.PERMISSION_DENIED
    finally:
        assert sidecar.stop() == 0


def test_only_an_admin_is_told_where_the_lmdb_file_is(store: EmbeddedStore) -> None:
    with grpc.insecure_channel(store.target) as channel:
        stub = store_pb2_grpc.SegmentStoreStub(channel)
        for name, namespace in (("alice", "team-a"), ("root", "team-a")):
            request = pb.DescribeDataPlaneRequest(namespace=namespace)
            reply = stub.DescribeDataPlane(request, metadata=metadata(name))
            assert bool(reply.lmdb_path) is (name == "root"), name
