"""TLS and mTLS on gRPC and the admin API, with certificates generated in the test."""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.store import make_meta, make_payload
from helpers.tls import Pki, make_pki

from kvsplice.cli import main
from kvsplice.server.app import startup_line
from kvsplice.server.config import TlsConfig
from kvsplice.server.embedded import EmbeddedStore, loopback_config
from kvsplice.storeclient.client import StoreClient
from kvsplice.storeclient.config import ClientTls, StoreClientConfig

FAST = StoreClientConfig(lookup_timeout_s=1.0, get_timeout_s=2.0, put_timeout_s=2.0, max_attempts=1)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest.fixture
def mtls_store(tmp_path: Path, pki: Pki) -> Iterator[EmbeddedStore]:
    tls = TlsConfig(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    with EmbeddedStore(loopback_config(None, tls=tls, admin_port=0)) as store:
        yield store


def client_tls(pki: Pki, with_cert: bool = True) -> ClientTls:
    if not with_cert:
        return ClientTls(ca_path=str(pki.ca))
    return ClientTls(str(pki.ca), str(pki.client_cert), str(pki.client_key))


def test_mtls_round_trip_and_refusals(mtls_store: EmbeddedStore, pki: Pki) -> None:
    payload = make_payload(10_000)
    meta = make_meta([1, 2, 3], payload)
    with StoreClient(mtls_store.target, meta.namespace, config=FAST, tls=client_tls(pki)) as ok:
        assert ok.put_segment(meta, payload)
        fetched = ok.get_segment(meta.context_key)
        assert fetched is not None and fetched[1] == payload
    # Plaintext, or TLS without a client certificate: no connection, so a miss.
    with StoreClient(mtls_store.target, meta.namespace, config=FAST) as plain:
        assert plain.get_segment(meta.context_key) is None
        assert plain.counters.num_degraded_calls == 1
    no_cert = client_tls(pki, with_cert=False)
    with StoreClient(mtls_store.target, meta.namespace, config=FAST, tls=no_cert) as anonymous:
        assert anonymous.get_segment(meta.context_key) is None


def test_admin_api_serves_https_to_client_certificates_only(
    mtls_store: EmbeddedStore, pki: Pki
) -> None:
    assert mtls_store._server is not None and mtls_store._server.admin is not None
    url = f"https://127.0.0.1:{mtls_store._server.admin.port}/v1/stats"
    context = ssl.create_default_context(cafile=str(pki.ca))
    context.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    assert httpx.get(url, verify=context, timeout=5).status_code == 200
    anonymous = ssl.create_default_context(cafile=str(pki.ca))
    with pytest.raises(httpx.HTTPError):
        httpx.get(url, verify=anonymous, timeout=5)
    with pytest.raises(httpx.HTTPError):
        httpx.get(url.replace("https", "http"), timeout=5)


def test_client_tls_needs_cert_and_key_together() -> None:
    with pytest.raises(ValueError, match="together"):
        ClientTls(ca_path="ca.pem", cert_path="client.pem")


def test_the_startup_line_and_admin_url_say_https_when_tls_is_on(mtls_store: EmbeddedStore) -> None:
    server = mtls_store._server
    assert server is not None and server.admin is not None
    url = f"https://127.0.0.1:{server.admin.port}"
    assert mtls_store.admin_url == url
    assert f"admin+dashboard {url};" in startup_line(server)


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


def test_the_admin_cli_says_use_https_when_it_meets_tls_on_an_http_url(
    mtls_store: EmbeddedStore, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    assert mtls_store.admin_url is not None
    https_url = mtls_store.admin_url
    http_url = https_url.replace("https://", "http://")
    certs = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert)]
    certs += ["--tls-key", str(pki.client_key)]
    code, _, err = run_cli(["stats", "--admin-url", http_url, *certs], capsys)
    assert code == 2 and f"is plain HTTP, yet TLS is set: use {https_url}" in err
    code, _, err = run_cli(["stats", "--admin-url", http_url], capsys)
    assert code == 2 and f"(if the sidecar serves TLS: use {https_url})" in err
    code, out, _ = run_cli(["stats", "--json", "--admin-url", https_url, *certs], capsys)
    assert code == 0 and json.loads(out) == {"namespaces": []}
