"""The per-request opt-in contract: `kv_transfer_params: {"kvsplice": {"reuse": "gated"}}`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvsplice.integrations.vllm.reuse_request import requested_reuse


@pytest.mark.parametrize(
    ("params", "mode"),
    [
        (None, "exact"),
        ({}, "exact"),
        ({"other_connector": {"x": 1}}, "exact"),
        ({"kvsplice": {}}, "exact"),
        ({"kvsplice": {"reuse": "exact"}}, "exact"),
        ({"kvsplice": {"reuse": "gated"}}, "gated"),
    ],
)
def test_well_formed_params(params: object, mode: str) -> None:
    reuse = requested_reuse(SimpleNamespace(kv_transfer_params=params))
    assert reuse.mode == mode and reuse.problem is None
    assert reuse.approximate == (mode == "gated")


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        ("gated", "is a str"),
        ({"kvsplice": "gated"}, "must be an object"),
        ({"kvsplice": {"reuse": "naive"}}, "not in"),
        ({"kvsplice": {"reuse": "GATED"}}, "not in"),
        ({"kvsplice": {"reuse": "gated", "mode": "x"}}, "unknown keys"),
    ],
)
def test_malformed_params_get_exact_reuse_and_say_why(params: object, problem: str) -> None:
    reuse = requested_reuse(SimpleNamespace(kv_transfer_params=params))
    assert reuse.mode == "exact" and not reuse.approximate
    assert reuse.problem is not None and problem in reuse.problem


def test_a_request_without_the_attribute_is_exact() -> None:
    assert requested_reuse(object()).mode == "exact"
