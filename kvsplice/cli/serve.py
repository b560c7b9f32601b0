"""`kvsplice serve` and `kvsplice health`: the sidecar's flags, checked before anything is created.

`serve`'s flags are those of `ServerConfig`'s fields (`kvsplice.cli.config_options`), so a
new flag is a config field declared with `flag(...)`. Addresses, ports, the Redis URL's form and the
LMDB directory are checked up front so a mistake is one line on stderr, not a half-started
server. An unreachable Redis is not a mistake: the sidecar starts degraded (issue 15).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from kvsplice.cli.common import (
    LogLevel,
    LogLevelOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    TlsServerNameOpt,
    client_tls,
    fail,
    setup_logging,
    split_host_port,
)
from kvsplice.cli.config_options import config_parameters, with_parameters
from kvsplice.common.config_flags import build_config
from kvsplice.server.config import ServerConfig

AdminListenOpt = Annotated[
    str,
    typer.Option(
        "--admin-listen",
        envvar="KVSPLICE_ADMIN_LISTEN",
        help="host:port of the admin HTTP API and dashboard, or 'off'.",
    ),
]


def health(
    target: Annotated[
        str,
        typer.Option("--target", envvar="KVSPLICE_TARGET", help="host:port of the sidecar."),
    ] = "127.0.0.1:50051",
    timeout_s: Annotated[
        float, typer.Option("--timeout-s", min=0.01, help="Seconds to wait for the answer.")
    ] = 3.0,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    tls_server_name: TlsServerNameOpt = None,
) -> None:
    """Exit 0 if the sidecar's grpc.health.v1 Check answers SERVING (Docker healthcheck).

    Inside the sidecar's container it sees the sidecar's KVSPLICE_TLS_* variables: with TLS
    on, KVSPLICE_TLS_CA must name the CA that signed KVSPLICE_TLS_CERT (docs/operations.md).
    """
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvsplice.storeclient.channel import open_channel

    tls = client_tls(tls_ca, tls_cert, tls_key, tls_server_name)
    with open_channel(target, [], tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            # types-grpcio-health-checking's HealthStub declares no methods
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)  # type: ignore[attr-defined]
        except grpc.RpcError as exc:
            no_ca = tls is not None and tls_ca is None
            hint = " (no --tls-ca/KVSPLICE_TLS_CA: the system CAs checked it)" if no_ca else ""
            fail(f"unhealthy: {target}: {exc.code().name} {exc.details()}{hint}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    typer.echo(status)
    raise typer.Exit(0 if status == "SERVING" else 1)


def _serve_parameters() -> list[inspect.Parameter]:
    """The config's flags, `--admin-listen` (both admin fields) after `--listen`, the log level."""
    listen, *rest = config_parameters(ServerConfig)
    keyword = inspect.Parameter.KEYWORD_ONLY
    admin_listen = inspect.Parameter(
        "admin_listen", keyword, default="127.0.0.1:8081", annotation=AdminListenOpt
    )
    log_level = inspect.Parameter(
        "log_level", keyword, default=LogLevel.info, annotation=LogLevelOpt
    )
    return [listen, admin_listen, *rest, log_level]


@with_parameters(_serve_parameters())
def serve(**values: Any) -> None:
    """Run the store sidecar (gRPC + admin HTTP API + dashboard) until SIGTERM."""
    from kvsplice.common.errors import ServeRefused, StoreUnavailable
    from kvsplice.server.app import serve as run_server
    from kvsplice.server.listen_checks import check_serve

    setup_logging(values.pop("log_level"))
    admin_listen = values.pop("admin_listen")
    listen, lmdb_path = values["listen"], values["lmdb_path"]
    check_listen(listen)
    tls_cert, tls_key, tls_client_ca = (values[k] for k in ("tls_cert", "tls_key", "tls_client_ca"))
    if (tls_cert is None) != (tls_key is None) or (tls_client_ca and not tls_cert):
        fail("--tls-cert and --tls-key go together (--tls-client-ca needs them)", 2)
    admin = None if admin_listen == "off" else split_host_port(admin_listen, "--admin-listen")
    try:
        config = build_config(
            ServerConfig, values,
            admin_host=admin[0] if admin else "127.0.0.1", admin_port=admin[1] if admin else None,
        )  # fmt: skip
    except ValueError as exc:
        fail(f"invalid settings: {exc}", 2)
    check_bindable(listen, "--listen")
    if admin is not None:
        check_bindable(admin_listen, "--admin-listen")
    try:
        check_serve(config)  # TLS material (and the binds again): before any directory
    except ServeRefused as exc:
        fail(str(exc))
    make_lmdb_dir(lmdb_path)
    try:
        run_server(config)
    except (StoreUnavailable, ServeRefused) as exc:  # a race for the port, a locked LMDB
        fail(str(exc))


def check_listen(listen: str) -> None:
    if listen.startswith("unix:"):
        if not listen.removeprefix("unix:").strip("/"):
            raise typer.BadParameter(f"{listen!r} names no socket path", param_hint="'--listen'")
        return
    split_host_port(listen, "--listen")


def check_bindable(address: str, flag: str) -> None:
    """One line naming the flag now instead of a failed bind deep inside the server later."""
    from kvsplice.server.listen_checks import bind_failure

    if not address.startswith("unix:"):
        split_host_port(address, flag)
    reason = bind_failure(address)
    if reason is not None:
        fail(f"{flag} {address}: {reason}")


def make_lmdb_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"--lmdb-path {path}: cannot create the directory: {exc.strerror}")
    if not os.access(path, os.W_OK | os.X_OK):
        fail(f"--lmdb-path {path}: the directory is not writable")
