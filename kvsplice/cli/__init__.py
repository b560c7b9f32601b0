"""The `kvsplice` command line: the one place that reads flags and KVSPLICE_* env vars.

Each command builds a frozen config and hands it to a library entry point; imports are lazy
so `kvsplice serve` never loads torch. `main()` turns every user mistake into one line on
stderr and a non-zero exit; tracebacks appear only under `--log-level debug`.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, NoReturn

import typer
import typer.main

from kvsplice.cli import bench_serve as bench_serve  # registers `bench serve`
from kvsplice.cli import bench_sessions as bench_sessions  # registers `bench sessions`
from kvsplice.cli import inspect, serve, tenants, worker
from kvsplice.cli import judge as judge  # registers `bench judge` on worker.bench_app
from kvsplice.cli import vllm as vllm_cli  # registers `bench vllm` on worker.bench_app
from kvsplice.cli.common import CliError, debug_enabled

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # plain click help: one line per flag, no boxes, no `<bool>` column
    context_settings=CONTEXT,
    help="KV-cache reuse for multi-agent LLM inference: the store sidecar, worker tools, benchmarks.",
)


def package_version() -> str:
    try:
        return version("kvsplice")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"kvsplice {package_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    _version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """KV-cache reuse for multi-agent LLM inference: the store sidecar, worker tools, benchmarks."""


app.command()(serve.serve)
app.command()(serve.health)
app.command()(inspect.stats)
app.command("ls")(inspect.list_segments)
app.command()(inspect.delete)
app.command()(inspect.flush)
app.command()(worker.demo)
app.command()(worker.calibrate)
app.command("model-dir")(vllm_cli.model_dir)
app.add_typer(worker.bench_app, name="bench")
app.add_typer(tenants.tenants_app, name="tenants")


def _die(prefix: str, message: str, exit_code: int) -> NoReturn:
    typer.echo(f"{prefix}: error: {message}", err=True)
    sys.exit(exit_code)


def _one_line(exc: typer.TyperException) -> str:
    # typer's coercion prefixes pydantic's "Value error, " to choice errors.
    return " ".join(exc.format_message().replace("Value error, ", "").split())


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    command = typer.main.get_command(app)
    try:
        exit_code = command.main(args=argv, prog_name="kvsplice", standalone_mode=False)
    except typer.TyperException as exc:  # usage errors: bad flag, bad value, missing option
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            typer.echo(ctx.get_help())
            sys.exit(EXIT_USAGE)
        path = ctx.command_path if ctx is not None else "kvsplice"
        hint = f" (see {path} -h)" if ctx is not None else ""
        _die(path, _one_line(exc) + hint, exc.exit_code)
    except typer.Abort:
        _die("kvsplice", "aborted", 1)
    except KeyboardInterrupt:
        _die("kvsplice", "interrupted", EXIT_INTERRUPTED)
    except CliError as exc:
        if debug_enabled():
            raise
        _die(f"kvsplice {_command_name(argv)}".strip(), str(exc), exc.exit_code)
    except Exception as exc:
        if debug_enabled():
            raise
        message = f"{type(exc).__name__}: {exc} (rerun with --log-level debug for the traceback)"
        _die(f"kvsplice {_command_name(argv)}".strip(), message, 1)
    sys.exit(exit_code if isinstance(exit_code, int) else 0)


def _command_name(argv: list[str] | None) -> str:
    """'serve', 'bench core'...: the words before the first flag, for the error prefix."""
    words: list[str] = []
    for arg in sys.argv[1:] if argv is None else argv:
        if arg.startswith("-") or len(words) == 2 or (words and words[0] != "bench"):
            break
        words.append(arg)
    return " ".join(words)


if __name__ == "__main__":
    main()
