"""Typer options derived from the `flag`s of config fields (`common.config_flags`).

Each option's name, KVSPLICE_* variable (where the command reads any), type, bounds, default and
help come from the field it sets, so a command's flags are written once, beside the fields.
Building the config back from the parsed values is `common.config_flags.build_config`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args

import typer

from kvsplice.common.config_flags import FlagField, flag_fields

F = TypeVar("F", bound=Callable[..., Any])


def config_parameters(
    config: type, envvar_prefix: str | None = "KVSPLICE_"
) -> list[inspect.Parameter]:
    """One keyword parameter, annotated with its `typer.Option`, per flag of `config`; each
    reads the variable `envvar_prefix` + its name too (None: none, as a benchmark's flags,
    which the environment must not change unseen)."""
    return [_parameter(f, envvar_prefix) for f in flag_fields(config)]


def with_parameters(parameters: Sequence[inspect.Parameter]) -> Callable[[F], F]:
    """Give a `**values` command the signature typer reads its options from."""

    def decorate(command: F) -> F:
        command.__signature__ = inspect.Signature(list(parameters))  # type: ignore[attr-defined]
        return command

    return decorate


def _parameter(field: FlagField, envvar_prefix: str | None) -> inspect.Parameter:
    flag = field.flag
    kind = _option_type(field)
    default = field.default
    if flag.path and default is not None:
        default = Path(default)
    elif flag.choices and default is not None:
        default = kind(default)
    name = field.name.replace("_", "-")
    checked = flag.exists  # the path checks apply to a path that must exist; else typer's defaults
    option = typer.Option(
        f"--{name}/--no-{name}" if kind is bool else f"--{name}",
        envvar=None if envvar_prefix is None else f"{envvar_prefix}{field.name.upper()}",
        help=flag.help,
        callback=_csv_callback(field) if flag.csv else None,
        min=None if flag.csv else flag.min,  # a csv flag's callback checks each value's bounds
        max=None if flag.csv else flag.max,
        exists=checked,
        file_okay=flag.file_okay if checked else True,
        dir_okay=flag.dir_okay if checked else True,
        writable=flag.writable if checked else False,
        case_sensitive=not flag.choices,
    )
    annotation = Annotated[kind | None if default is None else kind, option]  # type: ignore[valid-type]
    return inspect.Parameter(
        field.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


def _csv_callback(field: FlagField) -> Callable[[str | None], tuple[Any, ...] | None]:
    """The values of a comma-separated flag (its help shows the text, its command the tuple)."""

    def split(text: str | None) -> tuple[Any, ...] | None:
        try:
            return None if text is None else field.split_csv(text)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from error

    return split


def _option_type(field: FlagField) -> Any:
    if field.flag.csv:
        return str
    if field.flag.choices:
        return StrEnum(field.name.title().replace("_", ""), {c: c for c in field.flag.choices})
    if field.flag.path:
        return Path
    types = [t for t in get_args(field.hint) if t is not type(None)]
    return types[0] if types else field.hint
