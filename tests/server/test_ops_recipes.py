"""The operations recipes work as written: a tenant's client with a token and TLS, the image's
healthcheck with TLS set through KVSPLICE_TLS_*, compose's Prometheus with auth on, SIGHUP to
the pid in `--pid-file`, and `/v1/stats` of an unknown namespace."""

from __future__ import annotations

import os
import re
import subprocess
import traceback
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from helpers.serve_process import start_serve
from helpers.store import make_meta, make_payload
from helpers.tls import Pki, make_pki

from kvsplice.cli import main
from kvsplice.common.errors import PermissionDenied, Unauthenticated
from kvsplice.server.config import TlsConfig
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.server.tenants import Tenant, TenantTable, token_sha256
from kvsplice.storeclient.client import StoreClient

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
TOKEN = "team-a-token-0123456789"


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


def write_tenants(path: Path, *tenants: tuple[str, str, tuple[str, ...]]) -> Path:
    table = TenantTable(tuple(Tenant(n, token_sha256(t), ns, "writer") for n, t, ns in tenants))
    path.write_text(table.dumps())
    return path


@pytest.fixture
def tls_tenant_store(tmp_path: Path, pki: Pki) -> Iterator[EmbeddedStore]:
    tenants = write_tenants(tmp_path / "tenants.json", ("team-a", TOKEN, ("team-a",)))
    tls = TlsConfig(str(pki.server_cert), str(pki.server_key))
    config = loopback_config(None, tls=tls, tenants_path=str(tenants), admin_port=0)
    with EmbeddedStore(config) as store:
        yield store


def readme_tenant_snippet() -> str:
    section = (
        (ROOT / "docs" / "client-api.md")
        .read_text()
        .split("## Using the client from a worker", 1)[1]
    )
    (snippet,) = [s for s in re.findall(r"```python\n(.*?)```", section, re.S) if "ClientTls" in s]
    return snippet


def test_the_readme_tenant_client_puts_and_reads_over_tls(
    tls_tenant_store: EmbeddedStore, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSPLICE_TOKEN", TOKEN)
    code = readme_tenant_snippet().replace('"127.0.0.1:50051"', repr(tls_tenant_store.target))
    scope: dict[str, object] = {}
    exec(compile(code.replace('"ca.pem"', repr(str(pki.ca))), "docs/client-api.md", "exec"), scope)
    store = scope["store"]
    assert isinstance(store, StoreClient)
    payload = make_payload(4096)
    meta = make_meta([1, 2, 3], payload, namespace="team-a")
    with store:
        assert store.put_segment(meta, payload)
        read = store.get_segment(meta.context_key)
    assert read is not None and read[1] == payload


@pytest.mark.parametrize(
    ("token", "namespace", "error", "hint"),
    [
        (None, "team-a", Unauthenticated, "pass the tenant's token: StoreClient(..., token=TOKEN)"),
        ("wrong", "team-a", Unauthenticated, "`kvsplice tenants add` prints it once"),
        (TOKEN, "team-b", PermissionDenied, "`kvsplice tenants list` shows its namespaces"),
    ],
)
def test_a_credential_mistake_is_one_clear_line_without_grpc_frames(
    token: str | None,
    namespace: str,
    error: type[Exception],
    hint: str,
    tls_tenant_store: EmbeddedStore,
    pki: Pki,
) -> None:
    from kvsplice.storeclient.config import ClientTls

    tls = ClientTls(ca_path=str(pki.ca))
    store = StoreClient(tls_tenant_store.target, namespace, token=token, tls=tls)
    with store, pytest.raises(error) as raised:
        store.lookup_prefix("kvfp1-" + "0" * 32, [1, 2, 3])
    message = str(raised.value)
    assert message.startswith(f"{tls_tenant_store.target} refused namespace {namespace!r}: ")
    assert hint in message and "\n" not in message
    printed = "".join(traceback.format_exception(raised.value))
    assert raised.value.__suppress_context__ and raised.value.__cause__ is None
    assert "_InactiveRpcError" not in printed and "tenacity" not in printed


def health(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        main(["health", *argv])
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), (out + err).strip()


def test_the_image_healthcheck_with_tls_set_through_the_environment(
    tls_tenant_store: EmbeddedStore,
    pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # What the container's environment holds with TLS on: the server's own cert and key.
    monkeypatch.setenv("KVSPLICE_TLS_CERT", str(pki.server_cert))
    monkeypatch.setenv("KVSPLICE_TLS_KEY", str(pki.server_key))
    target = ["--target", tls_tenant_store.target]  # 127.0.0.1:PORT, as in the HEALTHCHECK
    code, line = health(target, capsys)
    assert code == 1 and line.endswith("(no --tls-ca/KVSPLICE_TLS_CA: the system CAs checked it)")
    monkeypatch.setenv("KVSPLICE_TLS_CA", str(pki.ca))  # what docs/operations.md says to add
    assert health(target, capsys) == (0, "SERVING")
    monkeypatch.setenv("KVSPLICE_TLS_SERVER_NAME", "localhost")  # a name the cert holds
    assert health(target, capsys) == (0, "SERVING")
    monkeypatch.setenv("KVSPLICE_TLS_SERVER_NAME", "elsewhere.example")
    assert health(target, capsys)[0] == 1
    assert "KVSPLICE_TLS_CA" in OPERATIONS and "KVSPLICE_TLS_SERVER_NAME" in OPERATIONS


def test_compose_prometheus_scrapes_with_the_auth_token(tmp_path: Path) -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["prometheus"]
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"][0]
    token_file = scrape["authorization"]["credentials_file"]
    assert scrape["authorization"].get("type", "Bearer") == "Bearer"
    assert (
        compose["entrypoint"] == ["/bin/sh", "-c"]
        and "KVSPLICE_AUTH_TOKEN" in compose["environment"]
    )
    (script,) = compose["command"]
    writer, _, starter = script.partition("&&")
    assert starter.split()[:2] == ["exec", "/bin/prometheus"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in starter.split()
    assert any(v.endswith(":/etc/prometheus/prometheus.yml:ro") for v in compose["volumes"])
    # run the writer as compose would (`$$` is compose's escape for `$`), then scrape as
    # Prometheus does: `Authorization: Bearer <file content>`
    local = tmp_path / "kvsplice-token"
    writer = writer.replace("$$", "$").replace(token_file, str(local))
    for auth_token in ("s3cret-admin-token", None):
        env = {**os.environ, "KVSPLICE_AUTH_TOKEN": auth_token or ""}
        subprocess.run(["sh", "-c", writer], env=env, check=True)
        with EmbeddedStore(loopback_config(None, admin_port=0, auth_token=auth_token)) as store:
            url = f"{store.admin_url}/metrics"
            bearer = {"Authorization": f"Bearer {local.read_text().strip()}"}
            assert httpx.get(url, headers=bearer, timeout=5).status_code == 200
            if auth_token:
                assert httpx.get(url, timeout=5).status_code == 401


def test_stats_of_an_unknown_namespace_are_empty(tmp_path: Path) -> None:
    with EmbeddedStore(loopback_config(None, admin_port=0)) as store:
        payload = make_payload(1024)
        with StoreClient(store.target, "known") as client:
            assert client.put_segment(make_meta([7, 8], payload, namespace="known"), payload)
        stats = f"{store.admin_url}/v1/stats"
        assert httpx.get(stats, params={"namespace": "unknown"}).json() == {"namespaces": []}
        rows = httpx.get(stats, params={"namespace": "known"}).json()["namespaces"]
        assert [(r["namespace"], r["num_segments"]) for r in rows] == [("known", 1)]


def test_the_sighup_recipe_reloads_the_tenants_of_that_sidecar(tmp_path: Path) -> None:
    (recipe,) = [line for line in OPERATIONS.splitlines() if line.startswith("kill -HUP ")]
    (serve_line,) = [line for line in OPERATIONS.splitlines() if "serve --tenants /etc" in line]
    documented = "/run/kvsplice/kvsplice.pid"
    assert f"--pid-file {documented}" in serve_line and documented in recipe
    tenants = write_tenants(tmp_path / "tenants.json", ("team-a", TOKEN, ("team-a",)))
    lmdb = ["--lmdb-path", str(tmp_path / "lmdb"), "--memory-mib", "0"]
    sidecar = start_serve(tmp_path / "sidecar", "--tenants", str(tenants), *lmdb, admin=False)
    try:
        new_token = "team-b-token-0123456789"
        write_tenants(tenants, ("team-a", TOKEN, ("team-a",)), ("team-b", new_token, ("team-b",)))
        line = recipe.split("#")[0].replace(documented, str(sidecar.pid_file))
        subprocess.run(["sh", "-c", line], check=True)
        payload = make_payload(512)
        meta = make_meta([5], payload, namespace="team-b")
        with StoreClient(sidecar.target, "team-b", token=new_token) as client:
            wait_until(lambda: accepted(client, meta, payload))
        assert sidecar.process.poll() is None  # reloaded, not killed
    finally:
        assert sidecar.stop() == 0


def accepted(client: StoreClient, meta, payload: bytes) -> bool:
    try:
        return client.put_segment(meta, payload)
    except Unauthenticated:
        return False


def wait_until(probe, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    import time

    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.05)
