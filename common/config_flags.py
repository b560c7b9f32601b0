"""Command-line flags that config fields carry, and configs built back from their values.

A field a flag sets is declared with `flag(default, help, ...)`: its help, its flag's name
where that is not the field's, its bounds and units go into the field's metadata. The CLI
derives its options from `flag_fields` (as vLLM's `arg_utils` derives its flags from config
fields), so a flag is written once, beside its field. Nothing here parses arguments.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

MIB = 1 << 20
_KEY = "kvsplice.flag"
C = TypeVar("C")


@dataclass(frozen=True)
class Flag:
    """How the command line sets a config field.

    `help` documents the field; `name` is the flag without `--` (default: the field's name,
    dashed); `cli_default` is the command line's default where it is not the field's, in the
    field's units; `mib`: the flag counts MiB of a field in bytes; `min`/`max`: bounds of
    the flag; `path`: it names a file (`exists`: one that exists; `dir_okay`: or a folder);
    `choices`: its values, case-insensitive; `switch`: the optional config holding the field
    exists only when the flag is set (neither None, "" nor 0).
    """

    help: str
    name: str | None = None
    cli_default: Any = ...  # the field's own
    mib: bool = False
    min: float | None = None
    max: float | None = None
    path: bool = False
    exists: bool = False
    dir_okay: bool = True
    choices: tuple[str, ...] = ()
    switch: bool = False

    def to_field(self, value: Any) -> Any:
        """The field's value of the flag's `value` ("" sets an optional field to None)."""
        if value is None or value == "":
            return None
        if self.mib:
            return value * MIB
        return str(value) if self.path or self.choices else value


def flag(default: Any, help: str, **options: Any) -> Any:
    """A dataclass field of `default` (`MISSING`: none) that the command line sets, documented
    by `help` (`Flag` says what `options` mean)."""
    return dataclasses.field(default=default, metadata={_KEY: Flag(help, **options)})


@dataclass(frozen=True)
class FlagField:
    """A field a flag sets: its `Flag`, its field and its type hint."""

    flag: Flag
    field: dataclasses.Field[Any]
    hint: Any

    @property
    def name(self) -> str:
        """The flag's name with underscores (the CLI parameter's name)."""
        return (self.flag.name or self.field.name).replace("-", "_")

    @property
    def default(self) -> Any:
        """The flag's default, in the flag's units."""
        default = self.field.default if self.flag.cli_default is ... else self.flag.cli_default
        if default is MISSING:
            raise TypeError(f"flag --{self.name} sets {self.field.name}, which has no default")
        return default // MIB if self.flag.mib and default is not None else default


def flag_fields(config: type) -> list[FlagField]:
    """The fields flags set in `config` and in the configs it nests, in field order."""
    found: list[FlagField] = []
    hints = get_type_hints(config)
    for f in fields(config):
        nested = nested_config(hints[f.name])
        if nested is not None:
            found += flag_fields(nested)
        elif _KEY in f.metadata:
            found.append(FlagField(f.metadata[_KEY], f, hints[f.name]))
    return found


def nested_config(hint: Any) -> type | None:
    """The config class a field of type `hint` holds (`X` or `X | None`), else None."""
    args = [a for a in get_args(hint) if a is not type(None)]
    if get_origin(hint) in (Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    return hint if isinstance(hint, type) and is_dataclass(hint) else None


def build_config(config: type[C], values: Mapping[str, Any], **overrides: Any) -> C:
    """`config` with every flagged field set from `values` (by `FlagField.name`, in the
    flag's units) and top-level fields from `overrides`; other fields keep their defaults.
    A nested optional config is None while one of its `switch` flags is unset.

    Raises ValueError as the configs' own validation does.
    """
    kwargs: dict[str, Any] = {}
    hints = get_type_hints(config)
    for f in fields(config):  # type: ignore[arg-type]
        nested = nested_config(hints[f.name])
        if nested is not None and flag_fields(nested):
            optional = type(None) in get_args(hints[f.name])
            kwargs[f.name] = (
                None if optional and not _switched_on(nested, values)
                else build_config(nested, values)
            )  # fmt: skip
        elif nested is None and _KEY in f.metadata:
            flagged = FlagField(f.metadata[_KEY], f, hints[f.name])
            kwargs[f.name] = flagged.flag.to_field(values[flagged.name])
    return config(**(kwargs | overrides))


def _switched_on(config: type, values: Mapping[str, Any]) -> bool:
    return all(values[f.name] for f in flag_fields(config) if f.flag.switch)
