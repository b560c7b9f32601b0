"""`kvsplice tenants add|list|rotate|remove` edit the tenants file `serve --tenants` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsplice.cli import main
from kvsplice.common.errors import Unauthenticated
from kvsplice.server.tenants import Authenticator


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(["tenants", *argv])
    out, err = capsys.readouterr()
    return int(exited.value.code or 0), out, err


def authenticated_as(file: Path, token: str) -> str | None:
    """The tenant `token` authenticates as with `file` loaded (None: refused)."""
    try:
        return Authenticator(file).authenticate(f"Bearer {token}").name
    except Unauthenticated:
        return None


def test_add_list_rotate_remove(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "tenants.json"
    code, token_a, _ = run(
        ["add", "team-a", "-n", "team-a", "-n", "team-a-*", "--file", str(file)], capsys
    )
    assert code == 0
    code, token_ops, _ = run(["add", "ops", "--role", "admin", "--file", str(file)], capsys)
    token_a, token_ops = token_a.strip(), token_ops.strip()
    assert authenticated_as(file, token_a) == "team-a"

    code, out, _ = run(["list", "--file", str(file)], capsys)
    assert code == 0
    assert out.splitlines() == ["team-a\twriter\tteam-a,team-a-*", "ops\tadmin\t(every namespace)"]
    assert (
        token_a not in out and json.loads(file.read_text())["tenants"][0]["token_sha256"] not in out
    )

    code, rotated, err = run(["rotate", "team-a", "--file", str(file)], capsys)
    rotated = rotated.strip()
    assert code == 0 and rotated not in ("", token_a) and "SIGHUP" in err
    assert (authenticated_as(file, token_a), authenticated_as(file, rotated)) == (None, "team-a")
    assert file.stat().st_mode & 0o777 == 0o600

    code, _, err = run(["remove", "team-a", "--file", str(file)], capsys)
    assert code == 0 and "SIGHUP" in err
    assert authenticated_as(file, rotated) is None and authenticated_as(file, token_ops) == "ops"
    code, out, _ = run(["list", "--file", str(file)], capsys)
    assert out.splitlines() == ["ops\tadmin\t(every namespace)"]


@pytest.mark.parametrize("command", ["remove", "rotate"])
def test_an_unknown_tenant_is_one_line_and_leaves_the_file(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "tenants.json"
    run(["add", "ops", "--role", "admin", "--file", str(file)], capsys)
    before = file.read_text()
    code, out, err = run([command, "nobody", "--file", str(file)], capsys)
    assert (code, out) == (2, "")
    assert err.strip() == f"kvsplice tenants: error: {file}: no tenant 'nobody'"
    assert file.read_text() == before


def test_a_file_that_does_not_parse_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "tenants.json"
    file.write_text("{")
    code, _, err = run(["list", "--file", str(file)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and str(file) in err
