"""Typer options derived from the `flag`s of config fields (`common.config_flags`).

Each option's name, KVSPLICE_* variable, type, bounds, default and help come from the field
it sets, so a command's flags are written once, beside the fields. Building the config back
from the parsed values is `common.config_flags.build_config`.
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


def config_parameters(config: type) -> list[inspect.Parameter]:
    """One keyword parameter, annotated with its `typer.Option`, per flag of `config`."""
    return [_parameter(f) for f in flag_fields(config)]


def with_parameters(parameters: Sequence[inspect.Parameter]) -> Callable[[F], F]:
    """Give a `**values` command the signature typer reads its options from."""

    def decorate(command: F) -> F:
        command.__signature__ = inspect.Signature(list(parameters))  # type: ignore[attr-defined]
        return command

    return decorate


def _parameter(field: FlagField) -> inspect.Parameter:
    flag = field.flag
    kind = _option_type(field)
    default = field.default
    if flag.path and default is not None:
        default = Path(default)
    elif flag.choices:
        default = kind(default)
    name = field.name.replace("_", "-")
    option = typer.Option(
        f"--{name}/--no-{name}" if kind is bool else f"--{name}",
        envvar=f"KVSPLICE_{field.name.upper()}",
        help=flag.help,
        min=flag.min,
        max=flag.max,
        **({"exists": True, "dir_okay": flag.dir_okay} if flag.exists else {}),
        **({"case_sensitive": False} if flag.choices else {}),
    )
    annotation = Annotated[kind | None if default is None else kind, option]  # type: ignore[valid-type]
    return inspect.Parameter(
        field.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


def _option_type(field: FlagField) -> Any:
    if field.flag.choices:
        return StrEnum(  # type: ignore[call-overload]
            field.name.title().replace("_", ""), {c: c for c in field.flag.choices}
        )
    if field.flag.path:
        return Path
    types = [t for t in get_args(field.hint) if t is not type(None)]
    return types[0] if types else field.hint
