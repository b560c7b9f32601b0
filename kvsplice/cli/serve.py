"""`kvsplice serve` and `kvsplice health`: the sidecar's flags, checked before anything is created.

Every flag becomes a frozen config here; addresses, ports, the Redis URL's form and the
LMDB directory are checked up front so a mistake is one line on stderr, not a half-started
server. An unreachable Redis is not a mistake: the sidecar starts degraded (issue 15).
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated

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

MIB = 1 << 20


class MemoryPolicy(StrEnum):
    lru = "lru"
    lfu = "lfu"


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

    from kvsplice.client.store.store_channel import open_channel

    tls = client_tls(tls_ca, tls_cert, tls_key, tls_server_name)
    with open_channel(target, [], tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as exc:
            no_ca = tls is not None and tls_ca is None
            hint = " (no --tls-ca/KVSPLICE_TLS_CA: the system CAs checked it)" if no_ca else ""
            fail(f"unhealthy: {target}: {exc.code().name} {exc.details()}{hint}")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    typer.echo(status)
    raise typer.Exit(0 if status == "SERVING" else 1)


def serve(
    listen: Annotated[
        str,
        typer.Option(envvar="KVSPLICE_LISTEN", help="gRPC address: host:port or unix:/path."),
    ] = "127.0.0.1:50051",
    admin_listen: Annotated[
        str,
        typer.Option(
            envvar="KVSPLICE_ADMIN_LISTEN",
            help="host:port of the admin HTTP API and dashboard, or 'off'.",
        ),
    ] = "127.0.0.1:8081",
    lmdb_path: Annotated[
        Path,
        typer.Option(envvar="KVSPLICE_LMDB_PATH", help="Durable tier directory (created)."),
    ] = Path("kvsplice-data/lmdb"),
    lmdb_map_size_mib: Annotated[
        int,
        typer.Option(
            envvar="KVSPLICE_LMDB_MAP_SIZE_MIB", min=1, help="LMDB tier budget (its map size)."
        ),
    ] = 4096,
    lmdb_sync: Annotated[
        bool,
        typer.Option(envvar="KVSPLICE_LMDB_SYNC", help="fsync every LMDB commit."),
    ] = True,
    memory_mib: Annotated[
        int,
        typer.Option(
            envvar="KVSPLICE_MEMORY_MIB", min=0, help="Memory tier budget; 0 disables it."
        ),
    ] = 1024,
    memory_policy: Annotated[
        MemoryPolicy,
        typer.Option(
            envvar="KVSPLICE_MEMORY_POLICY",
            case_sensitive=False,
            help="What the memory tier evicts first.",
        ),
    ] = MemoryPolicy.lru,
    compress: Annotated[
        bool,
        typer.Option(
            envvar="KVSPLICE_COMPRESS", help="zstd on the LMDB tier (rarely pays on int8 KV)."
        ),
    ] = False,
    redis_url: Annotated[
        str | None,
        typer.Option(
            envvar="KVSPLICE_REDIS_URL",
            help="Shared Redis/Valkey tier: redis://, rediss://, valkey:// (a cluster takes "
            "host:port,host:port seeds). Unreachable at start: serve degraded, connect later.",
        ),
    ] = None,
    redis_cluster: Annotated[
        bool,
        typer.Option(
            envvar="KVSPLICE_REDIS_CLUSTER",
            help="--redis-url names seed nodes of a Redis/Valkey Cluster.",
        ),
    ] = False,
    redis_read_replicas: Annotated[
        bool,
        typer.Option(
            envvar="KVSPLICE_REDIS_READ_REPLICAS", help="Cluster reads may go to replicas."
        ),
    ] = False,
    quota_mib: Annotated[
        int | None,
        typer.Option(envvar="KVSPLICE_QUOTA_MIB", min=1, help="Per-namespace byte quota."),
    ] = None,
    default_ttl_s: Annotated[
        float | None,
        typer.Option(
            envvar="KVSPLICE_DEFAULT_TTL_S", help="TTL of segments put without one (none: keep)."
        ),
    ] = None,
    max_payload_mib: Annotated[
        int,
        typer.Option(
            envvar="KVSPLICE_MAX_PAYLOAD_MIB",
            min=1,
            help="Largest accepted segment payload (64: a 512-token segment of an 8B model, fp16).",
        ),
    ] = 64,
    max_inflight_upload_mib: Annotated[
        int,
        typer.Option(
            envvar="KVSPLICE_MAX_INFLIGHT_UPLOAD_MIB",
            min=1,
            help="Payload MiB all uploads in progress may declare together.",
        ),
    ] = 256,
    stream_idle_timeout_s: Annotated[
        float,
        typer.Option(
            envvar="KVSPLICE_STREAM_IDLE_TIMEOUT_S",
            min=0.1,
            help="Cut an upload (or a GetSegment reader) silent this long.",
        ),
    ] = 10.0,
    chunk_mib: Annotated[
        int,
        typer.Option(
            envvar="KVSPLICE_CHUNK_MIB", min=1, max=64, help="Stream frame size of payloads."
        ),
    ] = 4,
    auth_token: Annotated[
        str | None,
        typer.Option(
            envvar="KVSPLICE_AUTH_TOKEN", help="One admin token ('Bearer <token>') on every call."
        ),
    ] = None,
    tenants: Annotated[
        Path | None,
        typer.Option(
            "--tenants",
            envvar="KVSPLICE_TENANTS",
            exists=True,
            dir_okay=False,
            help="Tenants file (kvsplice tenants add): namespaces and role per token hash; "
            "re-read on SIGHUP.",
        ),
    ] = None,
    tls_cert: Annotated[
        Path | None,
        typer.Option(
            envvar="KVSPLICE_TLS_CERT", exists=True, help="Server certificate (PEM): TLS."
        ),
    ] = None,
    tls_key: Annotated[
        Path | None,
        typer.Option(envvar="KVSPLICE_TLS_KEY", exists=True, help="Its private key (PEM)."),
    ] = None,
    tls_client_ca: Annotated[
        Path | None,
        typer.Option(
            envvar="KVSPLICE_TLS_CLIENT_CA",
            exists=True,
            help="Require client certificates signed by this CA (mTLS).",
        ),
    ] = None,
    grace_period_s: Annotated[
        float,
        typer.Option(
            envvar="KVSPLICE_GRACE_PERIOD_S",
            min=0,
            help="On SIGTERM, how long in-flight RPCs may drain.",
        ),
    ] = 10.0,
    lsh_threshold: Annotated[
        float,
        typer.Option(
            envvar="KVSPLICE_LSH_THRESHOLD", min=0, max=1, help="MinHash LSH Jaccard threshold."
        ),
    ] = 0.6,
    lsh_num_perm: Annotated[
        int,
        typer.Option(envvar="KVSPLICE_LSH_NUM_PERM", min=16, help="MinHash permutations."),
    ] = 128,
    anchor_capacity: Annotated[
        int,
        typer.Option(
            envvar="KVSPLICE_ANCHOR_CAPACITY", min=1, help="Anchors kept per placeholder."
        ),
    ] = 20,
    anchor_window: Annotated[
        int,
        typer.Option(
            envvar="KVSPLICE_ANCHOR_WINDOW", min=1, help="Recent uses an anchor's score counts."
        ),
    ] = 5,
    log_level: LogLevelOpt = LogLevel.info,
) -> None:
    """Run the store sidecar (gRPC + admin HTTP API + dashboard) until SIGTERM."""
    from kvsplice.common.errors import ServeRefused, StoreUnavailable
    from kvsplice.index.anchor_pool import AnchorPoolConfig
    from kvsplice.index.similarity_index import SimilarityConfig
    from kvsplice.server.app import serve as run_server
    from kvsplice.server.config import SegmentServiceConfig, ServerConfig, TlsConfig
    from kvsplice.server.listen_checks import check_serve
    from kvsplice.storage.config import (
        LMDBTierConfig,
        MemoryTierConfig,
        RedisTierConfig,
        StoreConfig,
    )

    setup_logging(log_level)
    check_listen(listen)
    if (tls_cert is None) != (tls_key is None) or (tls_client_ca and not tls_cert):
        fail("--tls-cert and --tls-key go together (--tls-client-ca needs them)", 2)
    admin = None if admin_listen == "off" else split_host_port(admin_listen, "--admin-listen")
    try:
        store = StoreConfig(
            memory=MemoryTierConfig(max_bytes=memory_mib * MIB, policy=memory_policy.value)
            if memory_mib
            else None,
            lmdb=LMDBTierConfig(
                path=str(lmdb_path),
                map_size_bytes=lmdb_map_size_mib * MIB,
                compress=compress,
                sync=lmdb_sync,
            ),
            redis=RedisTierConfig(
                url=redis_url, cluster=redis_cluster, read_from_replicas=redis_read_replicas
            )
            if redis_url
            else None,
            default_quota_bytes=quota_mib * MIB if quota_mib else None,
        )
        config = ServerConfig(
            listen_address=listen,
            store=store,
            similarity=SimilarityConfig(threshold=lsh_threshold, num_perm=lsh_num_perm),
            anchor_pool=AnchorPoolConfig(capacity=anchor_capacity, window=anchor_window),
            service=SegmentServiceConfig(
                default_ttl_s=default_ttl_s, max_payload_nbytes=max_payload_mib * MIB
            ),
            auth_token=auth_token or None,
            tenants_path=str(tenants) if tenants else None,
            tls=TlsConfig(
                str(tls_cert), str(tls_key), str(tls_client_ca) if tls_client_ca else None
            )
            if tls_cert and tls_key
            else None,
            stream_idle_timeout_s=stream_idle_timeout_s,
            max_inflight_upload_nbytes=max_inflight_upload_mib * MIB,
            chunk_nbytes=chunk_mib * MIB,
            grace_period_s=grace_period_s,
            admin_host=admin[0] if admin else "127.0.0.1",
            admin_port=admin[1] if admin else None,
        )
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
