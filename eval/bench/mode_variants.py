"""Mode variants: a reuse mode with parameter overrides, written as a spec like `halo:h=4+eps=0.05`.

Owns `ModeVariant` (parsing, the canonical label, its store-namespace form and
the policy it builds). The parameters are the mode's knobs (its `Params`
metadata checks their ranges); running variants is `mode_runner`'s job.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from kvsplice.client.modes.admission import AdmissionPolicy, default_policy
from kvsplice.client.modes.base import ReusePolicy
from kvsplice.client.modes.params import describe, field_of, format_value, knobs, parse_value
from kvsplice.client.modes.registry import MODES, mode_spec
from kvsplice.common.errors import FingerprintMismatch

# NOTE: modes are comma-separated on the command line, so a spec's parameters are
# joined by "+" (no shell quoting needed); "1e+3" stays one value (see `_split_params`).
PARAM_SEPARATOR = "+"
MODE_SEPARATOR = ":"

ParamValue = int | float | str | None


@dataclass(frozen=True)
class ModeVariant:
    """`mode` (one of `MODES`) with `params` ((name, value), ...) overriding the base policy's.

    Names are the mode's knob names (`Params` metadata); `params` is kept in their
    declaration order, so equal variants have equal labels.
    """

    mode: str
    params: tuple[tuple[str, ParamValue], ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; modes: {', '.join(MODES)}")
        params_type = mode_spec(self.mode).params_type
        known = [k.name for k in knobs(params_type).values() if k.variant]
        names = [name for name, _ in self.params]
        if names and not known:
            raise ValueError(f"mode {self.mode!r} takes no parameters, got {', '.join(names)}")
        for name in names:
            if name not in known:
                raise ValueError(
                    f"unknown parameter {name!r} for {self.mode!r}; it takes {', '.join(known)}"
                    f"\n{describe(params_type)}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"parameter given twice in {self.mode!r}: {', '.join(names)}")
        params = tuple(sorted(self.params, key=lambda item: known.index(item[0])))
        object.__setattr__(self, "params", params)
        try:
            self.apply(params_type())
        except (ValueError, TypeError) as error:  # TypeError: a value of the wrong type
            raise ValueError(f"variant {self.label!r}: {error}") from error

    @classmethod
    def parse(cls, spec: str) -> ModeVariant:
        """`mode` or `mode:name=value+name=value`; ValueError naming what is wrong."""
        mode, has_params, rest = spec.strip().partition(MODE_SEPARATOR)
        if not has_params:
            return cls(mode)
        params = []
        for item in _split_params(rest):
            name, has_value, text = item.partition("=")
            if not (has_value and name and text):
                raise ValueError(f"parameter {item!r} in {spec!r} is not name=value")
            params.append((name, _parse_value(mode, name, text, spec)))
        return cls(mode, tuple(params))

    @property
    def label(self) -> str:
        """The canonical spec: `blend:r=0.43`, `halo:h=4+eps=0.05`, or the bare mode name."""
        if not self.params:
            return self.mode
        items = PARAM_SEPARATOR.join(f"{name}={format_value(v)}" for name, v in self.params)
        return f"{self.mode}{MODE_SEPARATOR}{items}"

    @property
    def namespace_label(self) -> str:
        """The label in store-namespace characters: `halo:h_4:eps_0.05`.

        Injective: values never hold "_" or ":", so distinct labels never share a namespace.
        """
        return self.label.replace("=", "_").replace(PARAM_SEPARATOR, MODE_SEPARATOR)

    def apply(self, params: Any) -> Any:
        """`params` (the mode's `Params`) with this variant's values (validated)."""
        fields: dict[str, ParamValue] = {}
        for name, value in self.params:
            field = field_of(type(params), name)
            if field is None:  # __post_init__ checked the names against this mode's knobs
                raise ValueError(f"unknown parameter {name!r} for {self.mode!r}")
            fields[field] = value
        return dataclasses.replace(params, **fields)

    def policy(self, fingerprint: str, base: AdmissionPolicy | None = None) -> ReusePolicy:
        """This variant's policy for the model `fingerprint`: `base`'s parameters (defaults when
        None) with this variant's overrides. Admission is not checked (benchmarks run any mode).
        """
        if base is not None and base.model_fingerprint != fingerprint:
            raise FingerprintMismatch(
                f"admission policy is for model {base.model_fingerprint}, not {fingerprint}"
            )
        spec = mode_spec(self.mode)
        if spec.routes:  # `gated`: the base policy (the safe default when None) routes
            return (base or default_policy(fingerprint)).policy_of(self.mode)
        params = spec.params_type() if base is None else base.params_of(self.mode)
        return spec.policy(self.apply(params))


def parse_variants(specs: str) -> tuple[ModeVariant, ...]:
    """Comma-separated specs, as the command line gives them."""
    return tuple(ModeVariant.parse(spec) for spec in specs.split(",") if spec.strip())


def _split_params(text: str) -> list[str]:
    # Split on "+" only before "name=", so an exponent such as 1e+3 stays in its value.
    return re.split(rf"\{PARAM_SEPARATOR}(?=[A-Za-z_]\w*=)", text)


def _parse_value(mode: str, name: str, text: str, spec: str) -> ParamValue:
    field_name = field_of(mode_spec(mode).params_type, name) if mode in MODES else None
    if field_name is None:  # unknown mode or parameter: the constructor says which
        return text
    try:
        return parse_value(mode_spec(mode).params_type, field_name, text)
    except ValueError as error:
        raise ValueError(f"bad value {text!r} for {mode} parameter {name!r} in {spec!r}") from error
