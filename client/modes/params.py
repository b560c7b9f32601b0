"""Mode parameters: the metadata each mode's frozen `Params` declares per field, and its readers.

Owns `Knob` (a parameter's variant name, help, range, choices and calibration
grid), `knob()` (declares a field with it) and the generic readers built on it:
range checks, variant text parsing, labels, and the JSON form of `policy.json`.
Which modes exist is `registry`'s; what a parameter does is its mode's.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

KNOB = "kvsplice.knob"
NONE_TEXT = "none"  # an optional parameter's "no value" in variant specs


class Params(Protocol):
    """A mode's parameters: a frozen dataclass whose fields are declared with `knob()`."""

    __dataclass_fields__: typing.ClassVar[dict[str, Any]]


@dataclass(frozen=True)
class NoParams:
    """The parameters of a mode that takes none (dense, exact, naive, mask)."""


@dataclass(frozen=True)
class Knob:
    """One parameter's metadata.

    name: how variant specs call it (`anchor:gamma=1`); symbol: how calibration
    labels show it (default `name`). [low, high]: the range (`low_open`: low
    excluded); choices: the allowed words of a text parameter. grid: the values
    calibration probes, from least to most compute saved (that order ranks
    equally measured candidates), with `grid_labels` naming them in tables;
    grid_with: other fields set while this one's grid is probed (their grids are
    not crossed otherwise). variant: False for a parameter no spec may set (a table).
    """

    name: str
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    grid: tuple[Any, ...] = ()
    grid_labels: tuple[str, ...] = ()
    grid_with: Mapping[str, Any] = field(default_factory=dict)
    symbol: str = ""
    variant: bool = True

    def __post_init__(self) -> None:
        if self.grid_labels and len(self.grid_labels) != len(self.grid):
            raise ValueError(f"knob {self.name!r}: {len(self.grid_labels)} labels for its grid")

    def label(self, value: object, index: int | None = None) -> str:
        """`γ=0.3`, or the grid label of grid value `index`."""
        if index is not None and self.grid_labels:
            return self.grid_labels[index]
        return f"{self.symbol or self.name}={format_value(value)}"


def knob(default: Any, name: str, help: str, **metadata: Any) -> Any:
    """A `Params` field with default `default` and its `Knob`."""
    return field(default=default, metadata={KNOB: Knob(name, help, **metadata)})


def knobs(params_type: type) -> dict[str, Knob]:
    """Field name → knob, in declaration order."""
    return {f.name: f.metadata[KNOB] for f in dataclasses.fields(params_type) if KNOB in f.metadata}


def field_of(params_type: type, name: str) -> str | None:
    """The field a variant parameter `name` sets (None: the mode has no such parameter)."""
    return next((f for f, k in knobs(params_type).items() if k.name == name and k.variant), None)


def check_ranges(params: object) -> None:
    """ValueError naming the first field outside its knob's range or choices."""
    hints = typing.get_type_hints(type(params))
    for name, spec in knobs(type(params)).items():
        value = getattr(params, name)
        if not spec.variant:
            continue
        _check_type(spec.name, value, hints[name])
        if value is None:
            continue
        if spec.choices and value not in spec.choices:
            raise ValueError(f"{spec.name} {value!r} not in {spec.choices}")
        if isinstance(value, int | float) and not _in_range(float(value), spec):
            raise ValueError(f"{spec.name} {value} must be in {_range_text(spec)}")


def parse_value(params_type: type, field_name: str, text: str) -> Any:
    """The value of `field_name` written as `text` in a variant spec (ValueError if not one)."""
    hint = typing.get_type_hints(params_type)[field_name]
    args = typing.get_args(hint) if _is_union(hint) else (hint,)
    if type(None) in args and text == NONE_TEXT:
        return None
    base = next(a for a in args if a is not type(None))
    if base is str:
        if not text.isalnum():
            raise ValueError(f"{text!r} is not a word")
        return text
    if base is int:
        return int(text)
    if base is float:
        return float(text)
    raise ValueError(f"{field_name} cannot be set in a variant")


def format_value(value: object) -> str:
    """A value as labels write it: `none`, `0.43`, `1e-05` ("+" separates parameters)."""
    if value is None:
        return NONE_TEXT
    if isinstance(value, float):
        return repr(value).replace("e+", "e")
    return str(value)


def describe(params_type: type) -> str:
    """One line per variant parameter: `gamma: <help> (0 ≤ x ≤ 1; default 0.3)`."""
    defaults = params_type()
    lines = []
    for name, spec in knobs(params_type).items():
        if spec.variant:
            limits = _range_text(spec) if spec.low is not None or spec.high is not None else ""
            allowed = "|".join(spec.choices) or limits
            default = format_value(getattr(defaults, name))
            lines.append(
                f"{spec.name}: {spec.help} ({allowed + '; ' if allowed else ''}default {default})"
            )
    return "\n".join(lines)


def to_json(params: object) -> dict[str, Any]:
    """Field name → value, tuples as lists (`policy.json`)."""
    return {name: _jsonable(getattr(params, name)) for name in knobs(type(params))}


def from_json(params_type: type, document: Mapping[str, Any]) -> Any:
    """`to_json`'s inverse; ValueError naming an unknown field or a bad value."""
    fields = knobs(params_type)
    unknown = sorted(set(document) - set(fields))
    if unknown:
        raise ValueError(f"unknown parameters {unknown}; known: {sorted(fields)}")
    return params_type(**{name: _from_jsonable(value) for name, value in document.items()})


def _check_type(name: str, value: object, hint: Any) -> None:
    allowed = typing.get_args(hint) if _is_union(hint) else (hint,)
    if float in allowed:
        allowed = (*allowed, int)  # an int is a float value (`r=1`)
    if isinstance(value, bool) or not isinstance(value, allowed):
        raise TypeError(f"{name} {value!r} is not a {hint}")


def _in_range(value: float, spec: Knob) -> bool:
    above = spec.low is None or (value > spec.low if spec.low_open else value >= spec.low)
    return above and (spec.high is None or value <= spec.high)


def _range_text(spec: Knob) -> str:
    low = "" if spec.low is None else f"{spec.low:g} {'<' if spec.low_open else '≤'} "
    high = "" if spec.high is None else f" ≤ {spec.high:g}"
    return f"{low}x{high}"


@functools.cache
def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, tuple | list) else value


def _from_jsonable(value: Any) -> Any:
    return tuple(_from_jsonable(v) for v in value) if isinstance(value, list) else value
