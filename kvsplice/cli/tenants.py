"""`kvsplice tenants add`: new tenant credentials for `kvsplice serve --tenants FILE`.

The token is printed once on stdout; the file keeps only its SHA-256 (`server.tenants`).
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from kvsplice.cli.common import fail

tenants_app = typer.Typer(no_args_is_help=True, help="Tenant credentials of `serve --tenants`.")


class Role(StrEnum):
    reader = "reader"
    writer = "writer"
    admin = "admin"


@tenants_app.command("add")
def add(
    name: Annotated[str, typer.Argument(help="Tenant name (unique in the file).")],
    namespace: Annotated[
        list[str] | None,
        typer.Option(
            "--namespace", "-n", help="A namespace, or a prefix ending in '*'; repeat for more."
        ),
    ] = None,
    role: Annotated[
        Role, typer.Option(case_sensitive=False, help="reader, writer or admin.")
    ] = Role.writer,
    file: Annotated[
        Path, typer.Option("--file", envvar="KVSPLICE_TENANTS", help="The tenants file.")
    ] = Path("tenants.json"),
) -> None:
    """Add a tenant and print its new token once (send the sidecar SIGHUP to load it)."""
    from kvsplice.server.tenants import Tenant, TenantTable, new_token, token_sha256

    token = new_token()
    try:
        tenant = Tenant(name, token_sha256(token), tuple(namespace or ()), role.value)
        table = TenantTable.load(file).with_tenant(tenant)
    except ValueError as error:
        fail(f"{file}: {error}", 2)
    file.parent.mkdir(parents=True, exist_ok=True)
    partial = file.with_name(file.name + ".tmp")
    partial.write_text(table.dumps())
    partial.chmod(0o600)
    os.replace(partial, file)  # atomic: a SIGHUP reload never reads half a file
    typer.echo(token)
    typer.echo(
        f"tenant {name!r} ({role.value}) added to {file}; the token is shown only once", err=True
    )
