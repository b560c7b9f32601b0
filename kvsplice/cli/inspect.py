"""`kvsplice stats`, `ls`, `delete` and `flush`: the admin HTTP API from a terminal.

Tables use human units; `--json` prints the API's JSON unchanged for scripts.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from kvsplice.cli.common import (
    AuthTokenOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    client_tls,
    console,
    fail,
)
from kvsplice.common.units import human_bytes

ADMIN_TIMEOUT_S = 5.0
AdminUrlOpt = Annotated[
    str,
    typer.Option(
        "--admin-url", envvar="KVSPLICE_ADMIN_URL", help="Base URL of the sidecar's admin API."
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the API's JSON instead of a table.")]


def admin_call(
    admin_url: str,
    method: str,
    path: str,
    params: dict[str, Any],
    token: str | None,
    tls: Any = None,
) -> dict[str, Any]:
    """One admin API call; `tls` (`ClientTls`) verifies an https URL with its CA and
    presents its client certificate (mTLS)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{admin_url.rstrip('/')}{path}"
    plain = admin_url.startswith("http://")
    if tls is not None and plain:
        fail(f"--admin-url {admin_url} is plain HTTP, yet TLS is set: {_use_https(admin_url)}", 2)
    verify: Any = True
    if tls is not None:
        import ssl

        verify = ssl.create_default_context(cafile=tls.ca_path)
        if tls.cert_path:
            verify.load_cert_chain(tls.cert_path, tls.key_path)
    try:
        reply = httpx.request(
            method, url, params=params, headers=headers, timeout=ADMIN_TIMEOUT_S, verify=verify
        )
    except httpx.HTTPError as exc:
        # A TLS listener closes a plaintext request unanswered.
        tls_likely = plain and isinstance(exc, httpx.RemoteProtocolError)
        hint = f" (if the sidecar serves TLS: {_use_https(admin_url)})" if tls_likely else ""
        fail(f"cannot reach the admin API at {admin_url}: {exc}{hint}", 2)
    if reply.status_code != 200:
        try:
            detail = reply.json().get("detail", reply.text)
        except ValueError:
            detail = reply.text
        fail(f"{method} {path}: HTTP {reply.status_code}: {detail}")
    return reply.json()


def _use_https(admin_url: str) -> str:
    return f"use https://{admin_url.removeprefix('http://')}"


def _print_json(body: object) -> None:
    typer.echo(json.dumps(body, indent=2))


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1%}"


def _chain(exact: bool | None) -> str:
    """`ls`'s mark: off-chain segments hold K/V computed over approximate reuse."""
    return "-" if exact is None else "exact" if exact else "off-chain"


def stats(
    admin_url: AdminUrlOpt = "http://127.0.0.1:8081",
    namespace: Annotated[
        str | None, typer.Option("--namespace", "-n", help="Only this namespace.")
    ] = None,
    auth_token: AuthTokenOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Per-namespace segments, bytes and token hit rate from a running sidecar (with the
    reused tokens that were approximate)."""
    from rich.table import Table

    params = {"namespace": namespace} if namespace else {}
    body = admin_call(
        admin_url, "GET", "/v1/stats", params, auth_token, client_tls(tls_ca, tls_cert, tls_key)
    )
    if as_json:
        return _print_json(body)
    table = Table(
        "namespace", "segments", "stored", "token hit rate", "reused/prompt tokens",
        "local / in place / gRPC", "approximate",
    )  # fmt: skip
    for row in body.get("namespaces", []):
        by_source = row.get("hit_tokens_by_source") or {}
        table.add_row(
            row["namespace"], str(row["num_segments"]), human_bytes(row["stored_bytes"]),
            _percent(row.get("hit_rate")),
            f"{row.get('num_hit_tokens', 0)}/{row.get('num_requested_tokens', 0)}",
            " / ".join(str(by_source.get(s, 0)) for s in ("local", "in_place", "grpc")),
            str(row.get("num_approximate_hit_tokens", "-")),  # "-": a sidecar that cannot tell
        )  # fmt: skip
    console().print(table)


def list_segments(
    namespace: Annotated[str, typer.Option("--namespace", "-n", help="Namespace to list.")],
    admin_url: AdminUrlOpt = "http://127.0.0.1:8081",
    offset: Annotated[int, typer.Option(min=0, help="First row of the page.")] = 0,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Rows per page.")] = 50,
    auth_token: AuthTokenOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List a namespace's segments, one page at a time (off-chain ones marked)."""
    from rich.table import Table

    params = {"namespace": namespace, "offset": offset, "limit": limit}
    body = admin_call(
        admin_url, "GET", "/v1/segments", params, auth_token, client_tls(tls_ca, tls_cert, tls_key)
    )
    if as_json:
        return _print_json(body)
    table = Table("segment id", "tokens", "start", "layers", "size", "ttl", "chain")
    for seg in body.get("segments", []):
        ttl = seg.get("ttl_s")
        table.add_row(
            seg["segment_id"], str(seg["num_tokens"]), str(seg["start_position"]),
            f"{seg['layer_start']}-{seg['layer_end']}", human_bytes(seg["payload_nbytes"]),
            "-" if ttl is None else f"{ttl:g} s", _chain(seg.get("exact")),
        )  # fmt: skip
    console().print(table)
    if body.get("next_offset") is not None:
        typer.echo(f"more: --offset {body['next_offset']}")


def delete(
    segment_id: Annotated[str, typer.Argument(help="Segment id (hex), as `kvsplice ls` shows.")],
    namespace: Annotated[str, typer.Option("--namespace", "-n", help="Its namespace.")],
    admin_url: AdminUrlOpt = "http://127.0.0.1:8081",
    auth_token: AuthTokenOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
) -> None:
    """Delete one segment; exit 1 if it was not stored."""
    path = f"/v1/segments/{segment_id}"
    body = admin_call(
        admin_url,
        "DELETE",
        path,
        {"namespace": namespace},
        auth_token,
        client_tls(tls_ca, tls_cert, tls_key),
    )
    if not body.get("deleted"):
        fail(f"segment {segment_id} is not stored in namespace {namespace!r}")
    typer.echo(f"deleted {segment_id}")


def flush(
    namespace: Annotated[str, typer.Option("--namespace", "-n", help="Namespace to empty.")],
    admin_url: AdminUrlOpt = "http://127.0.0.1:8081",
    auth_token: AuthTokenOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
) -> None:
    """Delete every segment and anchor of a namespace."""
    if not yes:
        typer.confirm(f"delete everything in namespace {namespace!r}?", abort=True)
    body = admin_call(
        admin_url,
        "DELETE",
        f"/v1/namespaces/{namespace}",
        {},
        auth_token,
        client_tls(tls_ca, tls_cert, tls_key),
    )
    typer.echo(
        f"flushed {namespace}: {body['num_segments']} segments, "
        f"{human_bytes(body['freed_bytes'])} freed"
    )
