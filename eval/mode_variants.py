"""Mode variants: a reuse mode with parameter overrides, written as a spec like `halo:h=4+eps=0.05`.

Owns `ModeVariant` (parsing, the canonical label, its store-namespace form and
the policy it builds). The parameters are `AdmissionPolicy` fields, so their
ranges are the admission policy's to check; running variants is `mode_runner`'s job.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvsplice.client.admission import AdmissionPolicy
from kvsplice.client.policies import MODES, ReusePolicy, make_policy
from kvsplice.common.errors import FingerprintMismatch

# NOTE: modes are comma-separated on the command line, so a spec's parameters are
# joined by "+" (no shell quoting needed); "1e+3" stays one value (see `_split_params`).
PARAM_SEPARATOR = "+"
MODE_SEPARATOR = ":"
# Only checks value ranges before a model is loaded: the probe is never used to run.
_PROBE_FINGERPRINT = "kvfp1-" + "0" * 32

ParamValue = int | float | str | None


def _optional_float(text: str) -> float | None:
    return None if text == "none" else float(text)


def _word(text: str) -> str:
    if not text.isalnum():
        raise ValueError(f"{text!r} is not a word")
    return text


@dataclass(frozen=True)
class VariantParam:
    """One spec parameter: how its text parses, and the admission fields it sets."""

    parse: Callable[[str], ParamValue]
    overrides: Callable[[ParamValue], Mapping[str, object]]


# mode -> parameter name -> its parameter, in canonical label order; modes absent take none
PARAMS: dict[str, dict[str, VariantParam]] = {
    "blend": {"r": VariantParam(float, lambda v: {"blend_ratio": v})},
    "halo": {
        "h": VariantParam(int, lambda v: {"halo_tokens": v}),
        "eps": VariantParam(_optional_float, lambda v: {"halo_epsilon_nats": v}),
    },
    "anchor": {
        "gamma": VariantParam(float, lambda v: {"anchor_gamma": v}),
        "tau": VariantParam(float, lambda v: {"anchor_tau": v}),
        "metric": VariantParam(_word, lambda v: {"anchor_metric": v}),
        "r": VariantParam(_optional_float, lambda v: {"anchor_repair_ratio": v}),
        "cover": VariantParam(float, lambda v: {"anchor_min_coverage": v}),
    },
    # Cuts at or above `cut` reuse with no exact window; deeper ones need the whole left context.
    "multicut": {"cut": VariantParam(int, lambda v: {"w_exact": ((v, 0),)})},
}


@dataclass(frozen=True)
class ModeVariant:
    """`mode` (one of `MODES`) with `params` ((name, value), ...) overriding the base policy's.

    `params` is kept in `PARAMS` order, so equal variants have equal labels.
    """

    mode: str
    params: tuple[tuple[str, ParamValue], ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; modes: {', '.join(MODES)}")
        known = PARAMS.get(self.mode, {})
        names = [name for name, _ in self.params]
        if names and not known:
            raise ValueError(f"mode {self.mode!r} takes no parameters, got {', '.join(names)}")
        for name in names:
            if name not in known:
                raise ValueError(
                    f"unknown parameter {name!r} for {self.mode!r}; it takes {', '.join(known)}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"parameter given twice in {self.mode!r}: {', '.join(names)}")
        order = list(known)
        params = tuple(sorted(self.params, key=lambda item: order.index(item[0])))
        object.__setattr__(self, "params", params)
        try:
            dataclasses.replace(AdmissionPolicy(_PROBE_FINGERPRINT), **self.overrides())
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
        items = PARAM_SEPARATOR.join(f"{name}={_format(value)}" for name, value in self.params)
        return f"{self.mode}{MODE_SEPARATOR}{items}"

    @property
    def namespace_label(self) -> str:
        """The label in store-namespace characters: `halo:h_4:eps_0.05`.

        Injective: values never hold "_" or ":", so distinct labels never share a namespace.
        """
        return self.label.replace("=", "_").replace(PARAM_SEPARATOR, MODE_SEPARATOR)

    def overrides(self) -> dict[str, object]:
        """The `AdmissionPolicy` fields this variant sets."""
        fields: dict[str, object] = {}
        for name, value in self.params:
            fields.update(PARAMS[self.mode][name].overrides(value))
        return fields

    def policy(self, fingerprint: str, base: AdmissionPolicy | None = None) -> ReusePolicy:
        """This variant's policy for the model `fingerprint`: `base`'s parameters (defaults when
        None) with this variant's overrides. Admission is not checked (benchmarks run any mode).
        """
        if base is not None and base.model_fingerprint != fingerprint:
            raise FingerprintMismatch(
                f"admission policy is for model {base.model_fingerprint}, not {fingerprint}"
            )
        admission = dataclasses.replace(base or AdmissionPolicy(fingerprint), **self.overrides())
        return make_policy(self.mode, admission)


def parse_variants(specs: str) -> tuple[ModeVariant, ...]:
    """Comma-separated specs, as the command line gives them."""
    return tuple(ModeVariant.parse(spec) for spec in specs.split(",") if spec.strip())


def _split_params(text: str) -> list[str]:
    # Split on "+" only before "name=", so an exponent such as 1e+3 stays in its value.
    return re.split(rf"\{PARAM_SEPARATOR}(?=[A-Za-z_]\w*=)", text)


def _parse_value(mode: str, name: str, text: str, spec: str) -> ParamValue:
    param = PARAMS.get(mode, {}).get(name)
    if param is None:  # unknown mode or parameter: the constructor says which
        return text
    try:
        return param.parse(text)
    except ValueError as error:
        raise ValueError(f"bad value {text!r} for {mode} parameter {name!r} in {spec!r}") from error


def _format(value: ParamValue) -> str:
    if value is None:
        return "none"
    if isinstance(value, float):
        return repr(value).replace("e+", "e")  # "+" separates parameters in a label
    return str(value)
