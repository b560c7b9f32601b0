"""Every `kvsplice ...` that docker-compose.yml, the Dockerfile and docs/operations.md run exists.

Docker is not needed: the files are parsed and each command line is checked against
the typer app (`kvsplice.cli.app`) — subcommand, long options, option values, and
the KVSPLICE_* variables the compose file sets for it.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import pytest
import typer.main
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
OPERATIONS = ROOT / "docs" / "operations.md"
GRPC_PORT = "50051"
ADMIN_PORT = "8081"


@dataclass(frozen=True)
class Invocation:
    where: str
    argv: tuple[str, ...]
    env: tuple[str, ...] = ()  # KVSPLICE_* variables set for it


@dataclass
class Stage:
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    healthcheck: list[str] = field(default_factory=list)
    instructions: list[tuple[str, str]] = field(default_factory=list)


def _exec_form(text: str) -> list[str]:
    text = text.strip()
    return list(json.loads(text)) if text.startswith("[") else shlex.split(text)


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, rest) per instruction, with continuations joined and comments dropped."""
    logical, pending = [], ""
    for line in text.splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        logical.append(pending.strip())
        pending = ""
    return [(kw.upper(), rest) for kw, _, rest in (line.partition(" ") for line in logical)]


def dockerfile_stages(text: str) -> dict[str, Stage]:
    stages: dict[str, Stage] = {}
    current = Stage()
    for keyword, rest in dockerfile_instructions(text):
        if keyword == "FROM":
            parts = rest.split()
            parent = stages.get(parts[0])
            current = (
                Stage(list(parent.entrypoint), list(parent.cmd), list(parent.healthcheck))
                if parent
                else Stage()
            )
            if len(parts) >= 3 and parts[-2].lower() == "as":
                stages[parts[-1]] = current
        elif keyword == "ENTRYPOINT":
            current.entrypoint = _exec_form(rest)
        elif keyword == "CMD":
            current.cmd = _exec_form(rest)
        elif keyword == "HEALTHCHECK":
            match = re.search(r"\bCMD\s+(.*)$", rest)
            current.healthcheck = _exec_form(match.group(1)) if match else []
        current.instructions.append((keyword, rest))
    return stages


def _healthcheck_argv(test: str | list[str]) -> list[str]:
    if isinstance(test, str):
        return shlex.split(test)
    if test[0] == "CMD-SHELL":
        return shlex.split(test[1])
    return list(test[1:]) if test[0] == "CMD" else list(test)


def _kvsplice_env(environment: dict[str, object] | list[str] | None) -> tuple[str, ...]:
    if isinstance(environment, list):
        names = [item.partition("=")[0] for item in environment]
    else:
        names = list(environment or {})
    return tuple(sorted(name for name in names if name.startswith("KVSPLICE_")))


def compose_invocations() -> list[Invocation]:
    compose = yaml.safe_load(COMPOSE.read_text())
    stages = dockerfile_stages(DOCKERFILE.read_text())
    found = []
    for name, service in compose["services"].items():
        if "build" in service:
            target = service["build"].get("target", list(stages)[-1])
            command = service.get("command", stages[target].cmd)
            argv = stages[target].entrypoint + _exec_form_any(command)
            env = _kvsplice_env(service.get("environment"))
            found.append(Invocation(f"compose service {name!r} command", tuple(argv), env))
        if "healthcheck" in service:
            argv = _healthcheck_argv(service["healthcheck"]["test"])
            found.append(Invocation(f"compose service {name!r} healthcheck", tuple(argv)))
    return found


def _exec_form_any(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(x) for x in command]


def dockerfile_invocations() -> list[Invocation]:
    found = []
    for name, stage in dockerfile_stages(DOCKERFILE.read_text()).items():
        if stage.entrypoint or stage.cmd:
            found.append(
                Invocation(f"Dockerfile stage {name!r} CMD", tuple(stage.entrypoint + stage.cmd))
            )
        if stage.healthcheck:
            found.append(
                Invocation(f"Dockerfile stage {name!r} HEALTHCHECK", tuple(stage.healthcheck))
            )
    return found


def docs_invocations() -> list[Invocation]:
    """Lines of fenced code blocks in docs/operations.md that start with `kvsplice `."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", OPERATIONS.read_text(), flags=re.S)
    lines = (line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines())
    return [
        Invocation(f"docs/operations.md: {line}", tuple(shlex.split(line)))
        for line in lines
        if line.startswith("kvsplice ")
    ]


INVOCATIONS = [
    inv
    for inv in compose_invocations() + dockerfile_invocations() + docs_invocations()
    if inv.argv and inv.argv[0] == "kvsplice"
]


# typer >= 0.2x vendors click (`typer._click`), so the objects below are duck-typed
# click commands: groups have `.commands`, parameters have `.param_type_name`, `.opts`.
Command = Any


def cli_root() -> Command:
    try:
        from kvsplice.cli import app
    except ImportError as exc:
        pytest.fail(f"kvsplice.cli (the lead's typer app `app`) is not importable yet: {exc!r}")
    root = typer.main.get_command(app)
    assert hasattr(root, "commands"), "kvsplice.cli.app must have subcommands"
    return root


def _is_option(param: Any) -> bool:
    return param.param_type_name == "option"


def _is_argument(param: Any) -> bool:
    return param.param_type_name == "argument"


def resolve(root: Command, argv: Sequence[str], where: str) -> tuple[Command, list[str]]:
    """Walk subcommands (`kvsplice bench core ...`); return the leaf command and its arguments."""
    command, args = root, list(argv[1:])
    while hasattr(command, "commands"):
        if not args:
            pytest.fail(f"{where}: `{' '.join(argv)}` names no subcommand")
        sub = command.commands.get(args[0])
        if sub is None:
            pytest.fail(
                f"{where}: the kvsplice CLI has no command {args[0]!r} (it has: {', '.join(sorted(command.commands))})"
            )
        command, args = sub, args[1:]
    return command, args


def _options(command: Command) -> dict[str, Any]:
    return {opt: p for p in command.params if _is_option(p) for opt in (*p.opts, *p.secondary_opts)}


def argument_problems(command: Command, args: Sequence[str], env: Sequence[str]) -> list[str]:
    """Unknown options, options missing their value, extra positionals, unmet required params."""
    by_opt, problems, given, positionals = _options(command), [], set(), 0
    arguments = [p for p in command.params if _is_argument(p)]
    i = 0
    while i < len(args):
        token, i = args[i], i + 1
        if not token.startswith("-"):
            positionals += 1
            continue
        name, has_value, _ = token.partition("=")
        param = by_opt.get(name)
        if param is None:
            problems.append(f"unknown option {name} (known: {', '.join(sorted(by_opt))})")
            # Its value, if any, is not a positional argument: report one problem, not two.
            if not has_value and i < len(args) and not args[i].startswith("-"):
                i += 1
            continue
        given.add(param.name)
        if not (param.is_flag or param.count or has_value):
            if i >= len(args) or args[i].startswith("--"):
                problems.append(f"option {name} needs a value")
            i += 1
    if positionals > len(arguments) and not any(p.nargs == -1 for p in arguments):
        problems.append(
            f"{positionals} positional arguments but the command takes {len(arguments)}"
        )
    for p in command.params:
        if _is_option(p) and p.required and p.name not in given and p.envvar not in env:
            problems.append(
                f"required option {p.opts[0]} is neither passed nor set via its env var"
            )
    return problems


def _envvars(command: Command) -> set[str]:
    names: set[str] = set()
    for p in command.params:
        envvar = getattr(p, "envvar", None)
        names.update([envvar] if isinstance(envvar, str) else list(envvar or ()))
    return names


def test_the_deployment_files_run_the_expected_commands() -> None:
    """Guards against this file passing vacuously if a parser above stops finding things."""
    found = {(inv.where, inv.argv[1]) for inv in INVOCATIONS}
    assert ("compose service 'kvsplice' command", "serve") in found
    assert ("compose service 'kvsplice' healthcheck", "health") in found
    assert ("compose service 'worker' command", "demo") in found
    assert ("Dockerfile stage 'sidecar' CMD", "serve") in found
    assert ("Dockerfile stage 'sidecar' HEALTHCHECK", "health") in found
    assert ("Dockerfile stage 'worker' CMD", "demo") in found


@pytest.mark.parametrize(
    "invocation", INVOCATIONS, ids=lambda inv: f"{inv.where}: {' '.join(inv.argv[1:3])}"
)
def test_command_and_flags_exist_in_the_cli(invocation: Invocation) -> None:
    command, args = resolve(cli_root(), invocation.argv, invocation.where)
    problems = argument_problems(command, args, invocation.env)
    assert not problems, f"{invocation.where}: `{' '.join(invocation.argv)}`: {problems}"


@pytest.mark.parametrize(
    "invocation", [inv for inv in INVOCATIONS if inv.env], ids=lambda inv: inv.where
)
def test_compose_env_vars_are_read_by_the_command(invocation: Invocation) -> None:
    command, _ = resolve(cli_root(), invocation.argv, invocation.where)
    unread = sorted(set(invocation.env) - _envvars(command))
    assert not unread, f"{invocation.where}: `{invocation.argv[1]}` has no option reading {unread}"


def _flag_value(argv: Sequence[str], flag: str) -> str:
    for i, token in enumerate(argv):
        if token == flag:
            return argv[i + 1]
        if token.startswith(flag + "="):
            return token.split("=", 1)[1]
    raise AssertionError(f"{flag} not in {argv}")


@pytest.mark.parametrize("source", ["compose service 'kvsplice'", "Dockerfile stage 'sidecar'"])
def test_healthcheck_probes_the_port_that_serve_listens_on(source: str) -> None:
    serve = next(
        inv for inv in INVOCATIONS if inv.where.startswith(source) and inv.argv[1] == "serve"
    )
    health = next(
        inv for inv in INVOCATIONS if inv.where.startswith(source) and inv.argv[1] == "health"
    )
    assert _flag_value(serve.argv, "--listen").rsplit(":", 1)[1] == GRPC_PORT
    assert _flag_value(serve.argv, "--admin-listen").rsplit(":", 1)[1] == ADMIN_PORT
    assert _flag_value(health.argv, "--target") == f"127.0.0.1:{GRPC_PORT}"
    assert _flag_value(serve.argv, "--lmdb-path").startswith("/data/")


def test_sidecar_image_never_installs_torch_and_runs_unprivileged() -> None:
    stages = dockerfile_stages(DOCKERFILE.read_text())
    sidecar = stages["sidecar"]
    runs = " ".join(rest for kw, rest in sidecar.instructions if kw == "RUN")
    assert "torch==" not in runs and "[worker]" not in runs
    assert list(stages)[-1] == "sidecar", "the default build target must be the sidecar"
    for name in ("sidecar", "worker"):
        users = [rest for kw, rest in stages[name].instructions if kw == "USER"]
        assert users and users[-1] not in ("root", "0"), f"stage {name!r} runs as root"
    exposed = {port for kw, rest in sidecar.instructions if kw == "EXPOSE" for port in rest.split()}
    assert {GRPC_PORT, ADMIN_PORT} <= exposed


def test_valkey_is_configured_as_an_evicting_cache() -> None:
    valkey = yaml.safe_load(COMPOSE.read_text())["services"]["valkey"]
    assert valkey["image"].startswith("valkey/valkey:")
    command = _exec_form_any(valkey["command"])
    assert _flag_value(command, "--maxmemory-policy") == "allkeys-lru"
    assert _flag_value(command, "--save") == ""
    assert _flag_value(command, "--appendonly") == "no"
    assert "--maxmemory" in command


def test_published_ports_stay_on_loopback() -> None:
    for name, service in yaml.safe_load(COMPOSE.read_text())["services"].items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (
                f"service {name!r} publishes {port} beyond loopback"
            )


def make_contract_cli() -> Command:
    """The smallest CLI the deployment files need: what the lead's `kvsplice.cli` must offer."""
    contract = typer.Typer()

    @contract.command()
    def serve(
        listen: Annotated[str, typer.Option("--listen", envvar="KVSPLICE_LISTEN")] = "",
        admin_listen: Annotated[
            str, typer.Option("--admin-listen", envvar="KVSPLICE_ADMIN_LISTEN")
        ] = "",
        lmdb_path: Annotated[str, typer.Option("--lmdb-path", envvar="KVSPLICE_LMDB_PATH")] = "",
        redis_url: Annotated[str, typer.Option("--redis-url", envvar="KVSPLICE_REDIS_URL")] = "",
        redis_cluster: Annotated[
            bool, typer.Option("--redis-cluster", envvar="KVSPLICE_REDIS_CLUSTER")
        ] = False,
        auth_token: Annotated[str, typer.Option("--auth-token", envvar="KVSPLICE_AUTH_TOKEN")] = "",
        tenants: Annotated[str, typer.Option("--tenants", envvar="KVSPLICE_TENANTS")] = "",
        tls_cert: Annotated[str, typer.Option("--tls-cert", envvar="KVSPLICE_TLS_CERT")] = "",
        tls_key: Annotated[str, typer.Option("--tls-key", envvar="KVSPLICE_TLS_KEY")] = "",
        tls_client_ca: Annotated[
            str, typer.Option("--tls-client-ca", envvar="KVSPLICE_TLS_CLIENT_CA")
        ] = "",
        pid_file: Annotated[str, typer.Option("--pid-file", envvar="KVSPLICE_PID_FILE")] = "",
    ) -> None: ...

    @contract.command()
    def health(
        target: Annotated[str, typer.Option("--target", envvar="KVSPLICE_TARGET")] = "",
        tls_ca: Annotated[str, typer.Option("--tls-ca", envvar="KVSPLICE_TLS_CA")] = "",
        tls_cert: Annotated[str, typer.Option("--tls-cert", envvar="KVSPLICE_TLS_CERT")] = "",
        tls_key: Annotated[str, typer.Option("--tls-key", envvar="KVSPLICE_TLS_KEY")] = "",
    ) -> None: ...

    tenants = typer.Typer()
    contract.add_typer(tenants, name="tenants")

    @tenants.command("add")
    def tenants_add(
        name: Annotated[str, typer.Argument()],
        namespace: Annotated[list[str], typer.Option("--namespace")],
        role: Annotated[str, typer.Option("--role")] = "writer",
        file: Annotated[str, typer.Option("--file", envvar="KVSPLICE_TENANTS")] = "",
    ) -> None: ...

    @tenants.command("list")
    def tenants_list(
        file: Annotated[str, typer.Option("--file", envvar="KVSPLICE_TENANTS")] = "",
    ) -> None: ...

    @tenants.command("remove")
    def tenants_remove(
        name: Annotated[str, typer.Argument()],
        file: Annotated[str, typer.Option("--file", envvar="KVSPLICE_TENANTS")] = "",
    ) -> None: ...

    @tenants.command("rotate")
    def tenants_rotate(
        name: Annotated[str, typer.Argument()],
        file: Annotated[str, typer.Option("--file", envvar="KVSPLICE_TENANTS")] = "",
    ) -> None: ...

    @contract.command()
    def demo(
        store: Annotated[str, typer.Option("--store")] = "",
        out: Annotated[str, typer.Option("--out")] = "",
        auth_token: Annotated[str, typer.Option("--auth-token", envvar="KVSPLICE_AUTH_TOKEN")] = "",
        model_cache: Annotated[
            str, typer.Option("--model-cache", envvar="KVSPLICE_MODEL_CACHE")
        ] = "",
        verbose: bool = False,
    ) -> None: ...

    return typer.main.get_command(contract)


@pytest.mark.parametrize("invocation", INVOCATIONS, ids=lambda inv: inv.where)
def test_deployment_files_agree_with_the_contract_cli(invocation: Invocation) -> None:
    """Independent of the lead's progress: the files are consistent with the reported contract."""
    command, args = resolve(make_contract_cli(), invocation.argv, invocation.where)
    assert argument_problems(command, args, invocation.env) == []
    assert set(invocation.env) <= _envvars(command)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (("kvsplice", "demo", "--store", "h:1", "--verbose"), []),
        (("kvsplice", "demo", "--store=h:1", "--no-verbose"), []),
        (("kvsplice", "demo", "--stroe", "h:1"), ["unknown option --stroe"]),
        (("kvsplice", "demo", "--store"), ["option --store needs a value"]),
        (("kvsplice", "demo", "--store", "--verbose"), ["option --store needs a value"]),
        (("kvsplice", "demo", "stray"), ["1 positional arguments but the command takes 0"]),
    ],
)
def test_argument_checker_catches_what_it_should(
    argv: tuple[str, ...], expected: list[str]
) -> None:
    command, args = resolve(make_contract_cli(), argv, "test")
    problems = argument_problems(command, args, env=())
    assert [p.split(" (")[0] for p in problems] == expected


def test_unknown_subcommand_fails_with_a_clear_message() -> None:
    with pytest.raises(pytest.fail.Exception, match="no command 'sevre'"):
        resolve(make_contract_cli(), ("kvsplice", "sevre"), "test")
