"""Mode parameters: every mode's `Params` metadata, and the readers built on it."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.client.modes.admission import default_policy
from kvsplice.client.modes.anchor.policy import Params as AnchorParams
from kvsplice.client.modes.halo import Params as HaloParams
from kvsplice.client.modes.multicut import Params as MulticutParams
from kvsplice.client.modes.params import (
    KNOB,
    check_ranges,
    describe,
    field_of,
    format_value,
    from_json,
    knobs,
    parse_value,
    to_json,
)
from kvsplice.client.modes.registry import (
    CALIBRATED_MODES,
    JUDGE_CAPABLE_MODES,
    MODES,
    REGISTRY,
    SAFE_MODES,
)

FINGERPRINT = "kvfp1-" + "0" * 32


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_declares_frozen_params_whose_defaults_are_in_range(mode: str) -> None:
    params_type = REGISTRY[mode].params_type
    params = params_type()
    check_ranges(params)
    assert dataclasses.is_dataclass(params_type) and params_type.__dataclass_params__.frozen
    assert all(KNOB in f.metadata for f in dataclasses.fields(params_type))  # no bare field
    assert from_json(params_type, to_json(params)) == params
    spec = REGISTRY[mode]
    if spec.route is not None:  # a router is built from a whole admission policy
        assert spec.route(default_policy(FINGERPRINT)).mode == mode
        with pytest.raises(ValueError, match="admission policy"):
            spec.policy(params)
    else:
        assert spec.policy(params).mode == mode


def test_the_table_derives_the_mode_tuples() -> None:
    assert SAFE_MODES == ("dense", "exact")
    assert "mask" in MODES and "mask" not in CALIBRATED_MODES  # an ablation
    assert JUDGE_CAPABLE_MODES == ("crossfix",)  # calibrated by the judge probes only
    assert REGISTRY["gated"].routes  # routes to admitted modes: never calibrated itself
    assert set(CALIBRATED_MODES) == set(MODES) - set(SAFE_MODES) - {"mask", "crossfix", "gated"}


def test_every_grid_value_is_a_valid_parameter() -> None:
    for spec in REGISTRY.values():
        for name, knob in knobs(spec.params_type).items():
            for value in knob.grid:
                spec.params_type(**{**knob.grid_with, name: value})


@pytest.mark.parametrize(
    ("text", "value"), [("0.5", 0.5), ("1", 1.0), ("none", None), ("1e-06", 1e-06)]
)
def test_an_optional_float_parses_from_its_text(text: str, value: float | None) -> None:
    assert parse_value(AnchorParams, "repair_ratio", text) == value


def test_types_follow_the_annotation() -> None:
    assert parse_value(HaloParams, "num_halo", "4") == 4
    with pytest.raises(ValueError):
        parse_value(HaloParams, "num_halo", "4.5")
    with pytest.raises(ValueError):
        parse_value(AnchorParams, "metric", "no-word")
    with pytest.raises(ValueError, match="cannot be set"):
        parse_value(MulticutParams, "w_exact", "((4, 8),)")
    with pytest.raises(TypeError, match="h"):
        HaloParams(num_halo="4")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        HaloParams(num_halo=True)


def test_variant_names_map_to_fields() -> None:
    assert field_of(AnchorParams, "r") == "repair_ratio"
    assert field_of(AnchorParams, "cover") == "min_coverage"
    assert field_of(MulticutParams, "w_exact") is None  # a table: no variant sets it
    assert field_of(AnchorParams, "repair_ratio") is None


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_format_value_round_trips_floats(value: float) -> None:
    text = format_value(value)
    assert "+" not in text and float(text) == value


def test_describe_lists_each_variant_parameter_with_range_and_default() -> None:
    text = describe(AnchorParams)
    assert "gamma: " in text and "0 ≤ x ≤ 1" in text and "default 0.3" in text
    assert "metric: the gate's distance (value|key; default value)" in text
    assert "w_exact" not in describe(MulticutParams)


def test_unknown_json_fields_are_named() -> None:
    with pytest.raises(ValueError, match="'gama'"):
        from_json(AnchorParams, {"gama": 0.5})
