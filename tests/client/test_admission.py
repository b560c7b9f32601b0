"""The admission policy file: round trip, refusal for another model, the safe default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from client_factories import make_loaded
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.client.admission import (
    SAFE_MODES,
    AdmissionPolicy,
    ModeDrift,
    ModeNotAdmitted,
    default_policy,
    load_policy,
    save_policy,
)
from kvsplice.client.models import LoadedModel
from kvsplice.client.policies.blend import BlendPolicy
from kvsplice.client.policies.halo import HaloPolicy
from kvsplice.client.policies.multicut import MulticutPolicy
from kvsplice.client.reuse_engine import ReuseEngine
from kvsplice.common.errors import FingerprintMismatch

FINGERPRINT = "kvfp1-" + "ab" * 16
OTHER_FINGERPRINT = "kvfp1-" + "cd" * 16


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return make_loaded()


def make_policy_record(fingerprint: str = FINGERPRINT, **overrides: object) -> AdmissionPolicy:
    fields: dict[str, object] = {
        "model_fingerprint": fingerprint,
        "admitted_modes": ("dense", "exact", "multicut", "blend", "halo"),
        "w_exact": ((4, 16), (8, 64), (16, "full")),
        "blend_ratio": 0.2,
        "halo_tokens": 6,
        "halo_epsilon_nats": 0.05,
        "anchor_gamma": 0.25,
        "anchor_tau": 0.2,
        "created_at": "2025-01-02T03:04:05Z",
        "drift": {"multicut": ModeDrift(0.01, 0.04, 0.97, 120)},
    }
    fields.update(overrides)
    return AdmissionPolicy(**fields)  # type: ignore[arg-type]


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    policy = make_policy_record()
    path = tmp_path / "policy.json"
    save_policy(policy, path)
    assert load_policy(path, FINGERPRINT) == policy
    assert json.loads(path.read_text())["w_exact"] == [[4, 16], [8, 64], [16, "full"]]


windows = st.lists(st.integers(0, 512), min_size=1, max_size=4).map(sorted)


@given(
    windows=windows,
    ratio=st.floats(0, 1),
    halo=st.integers(0, 64),
    gamma=st.floats(0, 1),
    full_after=st.booleans(),
)
def test_any_valid_policy_round_trips_through_json(
    windows: list[int], ratio: float, halo: int, gamma: float, full_after: bool
) -> None:
    points: list[tuple[int, int | str]] = [(4 * (i + 1), w) for i, w in enumerate(windows)]
    if full_after:
        points.append((4 * (len(points) + 1), "full"))
    policy = make_policy_record(
        w_exact=tuple(points), blend_ratio=ratio, halo_tokens=halo, anchor_gamma=gamma
    )
    assert AdmissionPolicy.from_json(policy.to_json()) == policy


def test_a_policy_for_another_model_is_refused(tmp_path: Path, loaded: LoadedModel) -> None:
    path = tmp_path / "policy.json"
    save_policy(make_policy_record(OTHER_FINGERPRINT), path)
    with pytest.raises(FingerprintMismatch):
        load_policy(path, FINGERPRINT)
    with pytest.raises(FingerprintMismatch):
        ReuseEngine(loaded, "dense", admission=make_policy_record(OTHER_FINGERPRINT))


def test_without_a_policy_only_zero_drift_modes_are_admitted(loaded: LoadedModel) -> None:
    policy = load_policy(None, loaded.fingerprint)
    assert policy == default_policy(loaded.fingerprint)
    assert policy.admitted_modes == SAFE_MODES == ("dense", "exact")
    for mode in SAFE_MODES:
        assert ReuseEngine(loaded, mode, admission=policy).mode == mode
    for mode in ("naive", "anchor", "multicut", "blend", "halo"):
        with pytest.raises(ModeNotAdmitted, match=mode):
            ReuseEngine(loaded, mode, admission=policy)


def test_an_admitted_mode_takes_the_policy_parameters(loaded: LoadedModel) -> None:
    admission = make_policy_record(loaded.fingerprint)
    blend = ReuseEngine(loaded, "blend", admission=admission).policy
    halo = ReuseEngine(loaded, "halo", admission=admission).policy
    multicut = ReuseEngine(loaded, "multicut", admission=admission).policy
    assert isinstance(blend, BlendPolicy) and blend.config.ratio == 0.2
    assert isinstance(halo, HaloPolicy) and halo.config.num_halo == 6
    assert halo.config.acceptance is not None and halo.config.acceptance.epsilon_nats == 0.05
    assert isinstance(multicut, MulticutPolicy)
    assert multicut.config.w_exact(8) == 64 and multicut.config.w_exact(9) == "full"
    with pytest.raises(ModeNotAdmitted):
        ReuseEngine(loaded, "anchor", admission=admission)


def test_a_missing_policy_file_is_an_error_not_a_default(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_policy(tmp_path / "absent.json", FINGERPRINT)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("admitted_modes", ["exact"]),
        ("w_exact", [[4, 64], [8, 16]]),
        ("w_exact", [[4, "all"]]),
        ("blend_ratio", 1.5),
        ("anchor_tau", 0),
        ("format_version", 2),
        ("model_fingerprint", "not-a-fingerprint"),
    ],
)
def test_malformed_policies_are_refused_by_name(field: str, value: object) -> None:
    document = json.loads(make_policy_record().to_json())
    document[field] = value
    with pytest.raises(ValueError):
        AdmissionPolicy.from_json(json.dumps(document))
