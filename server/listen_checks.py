"""What `serve` will load and bind, checked before anything exists (no LMDB directory, no port).

Owns the up-front checks of TLS material (each PEM parses, the key is the certificate's),
of listen addresses (a unix socket's directory, a TCP port that binds) and of the pid file
(`pid_file.check_pid_file`); each failure
is `ServeRefused` with its real cause in one line. Binding itself is `app`'s.
"""

from __future__ import annotations

import errno
import os
import socket
import ssl
from collections.abc import Callable
from pathlib import Path

from kvsplice.common.errors import ServeRefused
from kvsplice.server.config import ServerConfig, TlsConfig
from kvsplice.server.pid_file import check_pid_file


def check_serve(config: ServerConfig) -> None:
    """Everything `build(config)` will load or bind, in the order it would fail."""
    if config.tls is not None:
        check_tls(config.tls)
    check_listen_address(config.listen_address)
    if config.admin_port is not None:
        check_listen_address(f"{_bracketed(config.admin_host)}:{config.admin_port}")
    if config.pid_file is not None:
        check_pid_file(Path(config.pid_file))


def check_tls(tls: TlsConfig) -> None:
    """ServeRefused unless the certificate and key parse and match (and the client CA
    holds a certificate): gRPC would log C-core lines and refuse to bind instead."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _load(context.load_verify_locations, tls.cert_path, "certificate", "holds no PEM certificate")
    try:
        context.load_cert_chain(tls.cert_path, tls.key_path, password=_no_password)
    except ssl.SSLError as error:
        if error.reason == "KEY_VALUES_MISMATCH":
            raise ServeRefused(
                f"TLS key {tls.key_path} does not match the certificate {tls.cert_path}"
            ) from error
        raise ServeRefused(
            f"TLS key {tls.key_path} holds no unencrypted PEM private key"
        ) from error
    except OSError as error:
        raise ServeRefused(f"TLS key {tls.key_path}: {error.strerror}") from error
    if tls.client_ca_path:
        _load(
            context.load_verify_locations,
            tls.client_ca_path,
            "client CA",
            "holds no PEM CA certificate",
        )


def check_listen_address(address: str) -> None:
    """ServeRefused if `address` (`host:port` or `unix:/path`) cannot be bound now."""
    reason = bind_failure(address)
    if reason is not None:
        raise ServeRefused(f"cannot listen on {address}: {reason}")


def bind_failure(address: str) -> str | None:
    """Why `address` cannot be bound now, or None. Port 0 always binds."""
    if address.startswith("unix:"):
        return _unix_failure(Path(address.removeprefix("unix:")))
    host, _, port = address.rpartition(":")
    if int(port) == 0:
        return None
    try:
        infos = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as error:
        return f"cannot resolve {host!r}: {error.strerror}"
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and uvicorn do
        try:
            probe.bind(sockaddr)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return "address already in use"
            return str(error.strerror)
    return None


_MAX_SUN_PATH_NBYTES = 107  # sockaddr_un.sun_path is 108 bytes on Linux, NUL included


def _unix_failure(path: Path) -> str | None:
    nbytes = len(os.fsencode(path))
    if nbytes > _MAX_SUN_PATH_NBYTES:
        return f"the socket path is {nbytes} bytes, over the {_MAX_SUN_PATH_NBYTES} a socket takes"
    directory = path.parent
    if not directory.is_dir():
        return f"directory {directory} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"directory {directory} is not writable"
    if path.exists() and not path.is_socket():
        return f"{path} exists and is not a socket"
    return None


def _load(load: Callable[[str], object], path: str, what: str, empty: str) -> None:
    try:
        load(path)
    except ssl.SSLError as error:
        raise ServeRefused(f"TLS {what} {path} {empty}") from error
    except OSError as error:
        raise ServeRefused(f"TLS {what} {path}: {error.strerror}") from error


def _no_password() -> bytes:
    # NOTE: without a callback OpenSSL would prompt on the terminal for an encrypted key.
    return b""


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
