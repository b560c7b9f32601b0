"""`kvsplice tenants add|list|remove|rotate`: the credentials of `kvsplice serve --tenants FILE`.

A new token is printed once on stdout; the file keeps only its SHA-256 (`server.tenants`)
and is replaced atomically, so a sidecar's SIGHUP reload never reads half a file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvsplice.cli.common import fail

if TYPE_CHECKING:
    from kvsplice.server.tenants import TenantTable

tenants_app = typer.Typer(no_args_is_help=True, help="Tenant credentials of `serve --tenants`.")

FileOpt = Annotated[
    Path, typer.Option("--file", envvar="KVSPLICE_TENANTS", help="The tenants file.")
]
NameArg = Annotated[str, typer.Argument(help="Tenant name (unique in the file).")]
RELOAD_HINT = "send the sidecar SIGHUP to apply it (docs/operations.md#tenants)"


class Role(StrEnum):
    reader = "reader"
    writer = "writer"
    admin = "admin"


@tenants_app.command("add")
def add(
    name: NameArg,
    namespace: Annotated[
        list[str] | None,
        typer.Option(
            "--namespace", "-n", help="A namespace, or a prefix ending in '*'; repeat for more."
        ),
    ] = None,
    role: Annotated[
        Role, typer.Option(case_sensitive=False, help="reader, writer or admin.")
    ] = Role.writer,
    file: FileOpt = Path("tenants.json"),
) -> None:
    """Add a tenant and print its new token once (send the sidecar SIGHUP to load it)."""
    from kvsplice.server.tenants import Tenant, new_token, token_sha256

    token = new_token()
    table = _edited(
        file,
        lambda table: table.with_tenant(
            Tenant(name, token_sha256(token), tuple(namespace or ()), role.value)
        ),
    )
    _save(table, file)
    typer.echo(token)
    shown = "the token is shown only once"
    typer.echo(f"tenant {name!r} ({role.value}) added to {file}; {shown}; {RELOAD_HINT}", err=True)


@tenants_app.command("list")
def list_tenants(file: FileOpt = Path("tenants.json")) -> None:
    """Print each tenant: name, role and namespaces (never a token or its hash)."""
    table = _edited(file, lambda table: table)
    if not table.tenants:
        typer.echo(f"no tenants in {file}", err=True)
    for tenant in table.tenants:
        namespaces = ",".join(tenant.namespaces) or "(every namespace)"
        typer.echo(f"{tenant.name}\t{tenant.role}\t{namespaces}")


@tenants_app.command("remove")
def remove(name: NameArg, file: FileOpt = Path("tenants.json")) -> None:
    """Remove a tenant: its token stops working once the sidecar reloads the file."""
    _save(_edited(file, lambda table: table.without(name)), file)
    typer.echo(f"tenant {name!r} removed from {file}; {RELOAD_HINT}", err=True)


@tenants_app.command("rotate")
def rotate(name: NameArg, file: FileOpt = Path("tenants.json")) -> None:
    """Give a tenant a new token, printed once; the old one stops working on reload."""
    from kvsplice.server.tenants import new_token, token_sha256

    token = new_token()
    _save(_edited(file, lambda table: table.with_token(name, token_sha256(token))), file)
    typer.echo(token)
    typer.echo(f"tenant {name!r}: new token (shown only once) in {file}; {RELOAD_HINT}", err=True)


def _edited(file: Path, edit: Callable[[TenantTable], TenantTable]) -> TenantTable:
    """`edit(table)` of the file's table; one line (exit 2) if the file or the edit is bad."""
    from kvsplice.server.tenants import TenantTable

    try:
        return edit(TenantTable.load(file))
    except ValueError as error:
        fail(f"{file}: {error}", 2)
    except OSError as error:
        fail(f"{file}: {error.strerror}")


def _save(table: TenantTable, file: Path) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_name(file.name + ".tmp")
    partial.write_text(table.dumps())
    partial.chmod(0o600)
    os.replace(partial, file)  # atomic: a SIGHUP reload never reads half a file
