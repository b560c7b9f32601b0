"""`serve` refuses what it cannot do before it creates anything: unusable TLS material, a unix
socket in a missing directory, an address it cannot bind. One line, the real cause, exit 1."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.tls import Pki, make_pki

from kvsplice.cli import main
from kvsplice.common.errors import ServeRefused
from kvsplice.server.config import TlsConfig
from kvsplice.server.embedded import EmbeddedStore, loopback_config

FREE_PORTS = ("--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0")


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    (tmp_path / "pki" / "garbage.pem").write_text("not a PEM file\n")
    return pki


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        yield sock.getsockname()[1]


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`kvsplice serve ARGV`'s exit status and its only stderr line."""
    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return int(exited.value.code or 0), lines[0]


def tls_flags(cert: Path, key: Path, client_ca: Path | None = None) -> list[str]:
    flags = ["--tls-cert", str(cert), "--tls-key", str(key)]
    return flags + (["--tls-client-ca", str(client_ca)] if client_ca else [])


@pytest.mark.parametrize(
    ("material", "cause"),
    [
        ("mismatched key", "TLS key {client_key} does not match the certificate {server_cert}"),
        ("garbage cert", "TLS certificate {garbage} holds no PEM certificate"),
        ("garbage key", "TLS key {garbage} holds no unencrypted PEM private key"),
        ("garbage client CA", "TLS client CA {garbage} holds no PEM CA certificate"),
        ("a key as client CA", "TLS client CA {server_key} holds no PEM CA certificate"),
    ],
)
def test_unusable_tls_material_is_one_line_and_creates_nothing(
    material: str, cause: str, pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "pki" / "garbage.pem"
    flags = {
        "mismatched key": tls_flags(pki.server_cert, pki.client_key),
        "garbage cert": tls_flags(garbage, pki.server_key),
        "garbage key": tls_flags(pki.server_cert, garbage),
        "garbage client CA": tls_flags(pki.server_cert, pki.server_key, garbage),
        "a key as client CA": tls_flags(pki.server_cert, pki.server_key, pki.server_key),
    }[material]
    lmdb = tmp_path / "data" / "lmdb"
    code, line = refusal([*FREE_PORTS, "--lmdb-path", str(lmdb), *flags], capsys)
    paths = {"garbage": garbage, **vars(pki)}
    assert (code, line) == (1, "kvsplice serve: error: " + cause.format(**paths))
    assert not (tmp_path / "data").exists()


def test_a_unix_socket_in_a_missing_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    socket_path = tmp_path / "missing" / "k.sock"
    argv = ["--listen", f"unix:{socket_path}", "--admin-listen", "off"]
    code, line = refusal([*argv, "--lmdb-path", str(tmp_path / "data")], capsys)
    assert code == 1
    assert line == (
        f"kvsplice serve: error: --listen unix:{socket_path}: "
        f"directory {socket_path.parent} does not exist"
    )
    assert not (tmp_path / "data").exists() and not socket_path.parent.exists()


def test_a_bind_failure_names_its_cause_not_always_address_in_use(
    busy_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    code, line = refusal(["--listen", f"127.0.0.1:{busy_port}", "--lmdb-path", str(data)], capsys)
    assert (code, line.endswith(f"127.0.0.1:{busy_port}: address already in use")) == (1, True)
    # TEST-NET-1 (RFC 5737) is never an address of this host
    code, line = refusal(["--listen", "192.0.2.1:50051", "--lmdb-path", str(data)], capsys)
    assert (code, line) == (
        1, "kvsplice serve: error: --listen 192.0.2.1:50051: Cannot assign requested address"
    )  # fmt: skip
    assert not data.exists()


@pytest.mark.parametrize("problem", ["mismatched key", "missing socket directory"])
def test_the_library_refuses_before_the_store_opens(problem: str, pki: Pki, tmp_path: Path) -> None:
    lmdb = tmp_path / "lmdb"
    if problem == "mismatched key":
        tls = TlsConfig(str(pki.server_cert), str(pki.client_key))
        config = loopback_config(str(lmdb), tls=tls)
        expected = "does not match the certificate"
    else:
        config = loopback_config(str(lmdb), listen_address=f"unix:{tmp_path}/missing/k.sock")
        expected = "does not exist"
    with pytest.raises(ServeRefused, match=expected):
        EmbeddedStore(config).start()
    assert not lmdb.exists()


def test_a_unix_socket_path_too_long_for_the_kernel_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    socket_path = tmp_path / ("s" * 120)  # sun_path holds 107 bytes and a NUL
    argv = ["--listen", f"unix:{socket_path}", "--admin-listen", "off"]
    code, line = refusal([*argv, "--lmdb-path", str(tmp_path / "data")], capsys)
    assert code == 1 and line.endswith(" bytes, over the 107 a socket takes")
    assert not (tmp_path / "data").exists()
