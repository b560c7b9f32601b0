"""Command-line flags that config fields carry, and configs built back from their values.

A field a flag sets is declared with `flag(default, help, ...)`: its help, its flag's name
where that is not the field's, its bounds and units go into the field's metadata. The CLI
derives its options from `flag_fields` (as vLLM's `arg_utils` derives its flags from config
fields), so a flag is written once, beside its field. Nothing here parses arguments.
"""

from __future__ import annotations

import dataclasses
import sys
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
    field's units (None on a field that cannot be None: the field's default); `mib`: the flag
    counts MiB of a field in bytes; `min`/`max`: bounds of the flag (of each value of a `csv`
    flag); `csv`: the tuple field's values, comma-separated ("": none); `path`: it names a file
    (`exists`: one that exists; `file_okay`/`dir_okay`: a file/a folder may do; `writable`: one
    this process may write); `choices`: its values, case-insensitive; `switch`: the optional
    config holding the field exists only when the flag is set (neither None, "" nor 0).
    """

    help: str
    name: str | None = None
    cli_default: Any = ...  # the field's own
    mib: bool = False
    min: float | None = None
    max: float | None = None
    csv: bool = False
    path: bool = False
    exists: bool = False
    file_okay: bool = True
    dir_okay: bool = True
    writable: bool = False
    choices: tuple[str, ...] = ()
    switch: bool = False

    def to_field(self, value: Any) -> Any:
        """The field's value of the flag's `value` ("" sets an optional field to None)."""
        if self.csv and value is not None:
            return tuple(value)
        if value is None or value == "":
            return None
        if self.mib:
            return value * MIB
        return str(value) if self.path or self.choices else value


def flag(default: Any, help: str, *, default_factory: Any = MISSING, **options: Any) -> Any:
    """A dataclass field of `default` (`MISSING`: none, or `default_factory`'s) that the command
    line sets, documented by `help` (`Flag` says what `options` mean)."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={_KEY: Flag(help, **options)}
    )


def existing_file_flag(help: str, name: str) -> Any:
    """An optional field (None: not given) that the flag `--name` sets to a file that must
    exist, documented by `help`."""
    return flag(None, help, name=name, path=True, exists=True, dir_okay=False)


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
        if self.flag.csv and default is not None:
            return ",".join(str(value) for value in default)
        return default // MIB if self.flag.mib and default is not None else default

    @property
    def optional(self) -> bool:
        """Whether the field may be None."""
        return type(None) in get_args(self.hint)

    def split_csv(self, text: str) -> tuple[Any, ...]:
        """The values of a `csv` flag's `text`, of the tuple's item type, within `min`/`max`.

        Raises ValueError naming `text`.
        """
        tuple_hint = next(h for h in (self.hint, *get_args(self.hint)) if get_origin(h) is tuple)
        item = get_args(tuple_hint)[0]
        try:
            values = tuple(item(value) for value in text.split(",")) if text else ()
        except ValueError:
            kind = {int: "integers", float: "numbers"}.get(item, item.__name__)
            raise ValueError(f"{text!r} is not a comma-separated list of {kind}") from None
        low, high = self.flag.min, self.flag.max
        if any((low is not None and v < low) or (high is not None and v > high) for v in values):
            bounds = [f"{op} {b:g}" for op, b in ((">=", low), ("<=", high)) if b is not None]
            raise ValueError(f"{text!r}: every value must be {' and '.join(bounds)}")
        return values


def flag_fields(config: type) -> list[FlagField]:
    """The fields flags set in `config` and in the configs it nests, in field order."""
    found: list[FlagField] = []
    hints = field_types(config)
    for f in fields(config):
        nested = nested_config(hints[f.name])
        if nested is not None:
            found += flag_fields(nested)
        elif _KEY in f.metadata:
            found.append(FlagField(f.metadata[_KEY], f, hints[f.name]))
    return found


def field_types(config: type) -> dict[str, Any]:
    """Each field's type. A type a config module imports for type checkers only (under
    TYPE_CHECKING, so that a torch-free config can name a field of a torch-side type) is `Any`
    there: no flag sets such a field, and it nests no config with flags."""
    try:
        return get_type_hints(config)
    except NameError:
        namespace = vars(sys.modules[config.__module__])
        return {f.name: _field_type(f, namespace) for f in fields(config)}


def _field_type(f: dataclasses.Field[Any], namespace: dict[str, Any]) -> Any:
    if not isinstance(f.type, str):
        return f.type
    try:
        return eval(f.type, namespace)  # what get_type_hints does, one field at a time
    except NameError:
        if _KEY in f.metadata:
            raise
        return Any


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
    hints = field_types(config)
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
            value = values[flagged.name]
            if value is not None or flagged.optional:
                kwargs[f.name] = flagged.flag.to_field(value)
    return config(**(kwargs | overrides))


def _switched_on(config: type, values: Mapping[str, Any]) -> bool:
    return all(values[f.name] for f in flag_fields(config) if f.flag.switch)
