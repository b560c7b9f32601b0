"""The admission policy file: round trip, refusal for another model, the safe default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.client import make_loaded
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.client.model.models import LoadedModel
from kvsplice.client.modes.admission import (
    SAFE_MODES,
    AdmissionPolicy,
    JudgeDrift,
    ModeDrift,
    ModeNotAdmitted,
    default_policy,
    load_policy,
    save_policy,
)
from kvsplice.client.modes.anchor.policy import Params as AnchorParams
from kvsplice.client.modes.blend import BlendPolicy
from kvsplice.client.modes.blend import Params as BlendParams
from kvsplice.client.modes.crossfix import Params as CrossfixParams
from kvsplice.client.modes.halo import HaloPolicy
from kvsplice.client.modes.halo import Params as HaloParams
from kvsplice.client.modes.multicut import MulticutPolicy
from kvsplice.client.modes.multicut import Params as MulticutParams
from kvsplice.client.modes.route_cost import CostModel
from kvsplice.client.reuse_engine import ReuseEngine
from kvsplice.common.errors import FingerprintMismatch

FINGERPRINT = "kvfp1-" + "ab" * 16
OTHER_FINGERPRINT = "kvfp1-" + "cd" * 16


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return make_loaded()


def make_policy_record(fingerprint: str = FINGERPRINT, **params: object) -> AdmissionPolicy:
    """A calibrated-looking policy; `params`: mode -> its `Params` replacing these."""
    by_mode: dict[str, object] = {
        "multicut": MulticutParams(w_exact=((4, 16), (8, 64), (16, "full"))),
        "blend": BlendParams(ratio=0.2),
        "halo": HaloParams(num_halo=6, epsilon_nats=0.05),
        "anchor": AnchorParams(gamma=0.25, tau=0.2),
    }
    by_mode.update(params)
    return AdmissionPolicy(
        fingerprint,
        admitted_modes=("dense", "exact", "multicut", "blend", "halo"),
        params=by_mode,
        created_at="2025-01-02T03:04:05Z",
        drift={"multicut": ModeDrift(0.01, 0.04, 0.97, 120)},
    )


# What `kvsplice calibrate` wrote before the mode registry (format version 1).
V1_DOCUMENT = {
    "format_version": 1, "model_fingerprint": FINGERPRINT,
    "admitted_modes": ["dense", "exact", "multicut", "blend", "halo"],
    "w_exact": [[4, 16], [8, 64], [16, "full"]], "blend_ratio": 0.2, "halo_tokens": 6,
    "halo_epsilon_nats": 0.05, "anchor_gamma": 0.25, "anchor_tau": 0.2, "anchor_metric": "value",
    "anchor_repair_ratio": None, "anchor_min_coverage": 1.0,
    "created_at": "2025-01-02T03:04:05Z",
    "drift": {"multicut": {"kl_mean_nats": 0.01, "kl_p95_nats": 0.04,
                           "first_token_agreement": 0.97, "num_calls": 120}},
}  # fmt: skip


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    policy = make_policy_record()
    path = tmp_path / "policy.json"
    save_policy(policy, path)
    assert load_policy(path, FINGERPRINT) == policy
    document = json.loads(path.read_text())
    assert document["params"]["multicut"]["w_exact"] == [[4, 16], [8, 64], [16, "full"]]


def test_a_version_1_file_still_loads_with_the_same_parameters(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(V1_DOCUMENT))
    assert load_policy(path, FINGERPRINT) == make_policy_record()


def test_a_version_1_file_with_an_unknown_field_is_refused() -> None:
    with pytest.raises(ValueError, match="halo_size"):
        AdmissionPolicy.from_json(json.dumps({**V1_DOCUMENT, "halo_size": 3}))


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
        multicut=MulticutParams(w_exact=tuple(points)),
        blend=BlendParams(ratio=ratio),
        halo=HaloParams(num_halo=halo),
        anchor=AnchorParams(gamma=gamma),
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
    assert isinstance(blend, BlendPolicy) and blend.params.ratio == 0.2
    assert isinstance(halo, HaloPolicy) and halo.params.num_halo == 6
    assert halo.params.epsilon_nats == 0.05
    assert isinstance(multicut, MulticutPolicy)
    assert multicut.w_exact(8) == 64 and multicut.w_exact(9) == "full"
    with pytest.raises(ModeNotAdmitted):
        ReuseEngine(loaded, "anchor", admission=admission)


def test_a_missing_policy_file_is_an_error_not_a_default(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_policy(tmp_path / "absent.json", FINGERPRINT)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("admitted_modes", ["exact"]),
        ("params", {"multicut": {"w_exact": [[4, 64], [8, 16]]}}),
        ("params", {"multicut": {"w_exact": [[4, "all"]]}}),
        ("params", {"blend": {"ratio": 1.5}}),
        ("params", {"blend": {"r": 0.5}}),
        ("params", {"anchor": {"tau": 0}}),
        ("params", {"cacheblend": {}}),
        ("format_version", 3),
        ("model_fingerprint", "not-a-fingerprint"),
    ],
)
def test_malformed_policies_are_refused_by_name(field: str, value: object) -> None:
    document = json.loads(make_policy_record().to_json())
    document[field] = value
    with pytest.raises(ValueError):
        AdmissionPolicy.from_json(json.dumps(document))


def test_the_cost_model_and_pass_keep_shares_round_trip_and_price_the_judge_mode(
    tmp_path: Path,
) -> None:
    cost = CostModel(2e-6, 1e-7, 0.004, 0.002, 0.001)
    policy = AdmissionPolicy(
        FINGERPRINT, admitted_modes=("dense", "exact", "crossfix"),
        params={"crossfix": CrossfixParams(check_layer=4, deep_check=20)},
        judge_modes=("crossfix",), judge_drift={"crossfix": JudgeDrift(1.0, 0.3, 24, (0.25, 0.8))},
        cost=cost,
    )  # fmt: skip
    path = tmp_path / "policy.json"
    save_policy(policy, path)
    loaded_back = load_policy(path, FINGERPRINT)
    assert loaded_back == policy
    pricing = loaded_back.judge_pricing
    assert pricing is not None
    assert (pricing.cost, pricing.checks, pricing.keep) == (cost, (4, 20), (0.25, 0.8))
    assert pricing.ratio == 0.0
    blended = policy.with_params("crossfix", CrossfixParams(check_layer=8, ratio=0.4))
    assert blended.judge_pricing is not None and blended.judge_pricing.ratio == 0.4
    assert not blended.judge_pricing.question
    asking = policy.with_params("crossfix", CrossfixParams(check_layer=8, question=1))
    assert asking.judge_pricing is not None and asking.judge_pricing.question
    # no cost model measured (an older file): the gate is not priced
    assert make_policy_record().judge_pricing is None
