"""gRPC channels toward the store, plaintext or TLS/mTLS (`ClientTls`), for the store client.

Owns credentials only; deadlines, retries and message limits are `config`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from kvsplice.storeclient.config import ClientTls

ChannelOptions = Sequence[tuple[str, Any]]


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The per-call metadata carrying `token` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def channel_credentials(tls: ClientTls) -> grpc.ChannelCredentials:
    def read(path: str | None) -> bytes | None:
        return None if path is None else Path(path).read_bytes()

    return grpc.ssl_channel_credentials(
        root_certificates=read(tls.ca_path),
        private_key=read(tls.key_path),
        certificate_chain=read(tls.cert_path),
    )


def _with_server_name(options: ChannelOptions, tls: ClientTls) -> list[tuple[str, Any]]:
    extra = [] if tls.server_name is None else [("grpc.ssl_target_name_override", tls.server_name)]
    return [*options, *extra]


def open_channel(target: str, options: ChannelOptions, tls: ClientTls | None) -> grpc.Channel:
    """A sync channel to `target`: TLS when `tls` is given, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(
        target, channel_credentials(tls), options=_with_server_name(options, tls)
    )
