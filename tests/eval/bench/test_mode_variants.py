"""Mode variant specs: parsing, canonical labels, namespaces, and the parameters of the built policy."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.client.modes.admission import AdmissionPolicy
from kvsplice.client.modes.anchor.policy import AnchorPolicy
from kvsplice.client.modes.anchor.policy import Params as anchor_params
from kvsplice.client.modes.blend import BlendPolicy
from kvsplice.client.modes.blend import Params as blend_params
from kvsplice.client.modes.dense import DensePolicy
from kvsplice.client.modes.halo import HaloPolicy
from kvsplice.client.modes.halo import Params as halo_params
from kvsplice.client.modes.multicut import ExactWindow, MulticutPolicy
from kvsplice.common.errors import FingerprintMismatch
from kvsplice.common.segment import validate_namespace
from kvsplice.eval.bench.mode_variants import ModeVariant, parse_variants

FINGERPRINT = "kvfp1-" + "ab" * 16
OTHER_FINGERPRINT = "kvfp1-" + "cd" * 16


@pytest.mark.parametrize(
    ("spec", "label", "params"),
    [
        ("blend", "blend", ()),
        (" exact ", "exact", ()),
        ("blend:r=0.43", "blend:r=0.43", (("r", 0.43),)),
        ("blend:r=.5", "blend:r=0.5", (("r", 0.5),)),
        ("halo:h=16", "halo:h=16", (("h", 16),)),
        ("halo:eps=0.05+h=4", "halo:h=4+eps=0.05", (("h", 4), ("eps", 0.05))),
        ("halo:h=4+eps=none", "halo:h=4+eps=none", (("h", 4), ("eps", None))),
        ("halo:eps=1e+3", "halo:eps=1000.0", (("eps", 1000.0),)),
        ("halo:eps=1e-06+h=2", "halo:h=2+eps=1e-06", (("h", 2), ("eps", 1e-06))),
        ("anchor:gamma=0.5", "anchor:gamma=0.5", (("gamma", 0.5),)),
        ("anchor:metric=key+tau=0.2", "anchor:tau=0.2+metric=key", (("tau", 0.2), ("metric", "key"))),
        ("multicut:cut=16", "multicut:cut=16", (("cut", 16),)),
    ],
)  # fmt: skip
def test_parse_gives_canonical_labels(spec: str, label: str, params: tuple) -> None:
    variant = ModeVariant.parse(spec)
    assert variant.label == label and variant.params == params
    assert ModeVariant.parse(variant.label) == variant  # the label is a spec of the same variant


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "unknown mode ''"),
        ("cacheblend:r=0.1", "unknown mode 'cacheblend'"),
        ("blend:ratio=0.1", "unknown parameter 'ratio' for 'blend'; it takes r"),
        ("exact:r=0.1", "mode 'exact' takes no parameters"),
        ("dense:", "not name=value"),
        ("blend:r", "not name=value"),
        ("blend:r=", "not name=value"),
        ("blend:r=abc", "bad value 'abc' for blend parameter 'r'"),
        ("halo:h=4.5", "bad value '4.5' for halo parameter 'h'"),
        ("halo:h=1+h=2", "given twice"),
        ("blend:r=1.5", "r 1.5 must be in"),
        ("halo:h=-1", "h -1 must be in"),
        ("halo:eps=-0.1", "eps -0.1 must be in"),
        ("anchor:metric=hidden", "metric 'hidden' not in"),
        ("anchor:tau=0", "tau 0.0 must be in 0 < x"),
        ("anchor:gamma=nan", "gamma nan must be in"),
        ("anchor:r=1.5", "r 1.5 must be in"),
        ("anchor:cover=0", "cover 0.0 must be in 0 < x ≤ 1"),
        ("multicut:cut=-4", "cut -4 must be in 0 ≤ x"),
    ],
)
def test_parse_rejects_bad_specs_naming_the_problem(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        ModeVariant.parse(spec)


def test_constructor_rejects_values_of_the_wrong_type() -> None:
    with pytest.raises(ValueError, match="blend:r=high"):
        ModeVariant("blend", (("r", "high"),))


def test_parse_variants_splits_the_command_line_list() -> None:
    variants = parse_variants("dense,blend:r=0.43,halo:h=4+eps=0.05,")
    assert [v.label for v in variants] == ["dense", "blend:r=0.43", "halo:h=4+eps=0.05"]


def test_namespace_labels_are_valid_store_namespaces() -> None:
    specs = ["dense", "blend:r=0.43", "halo:h=4+eps=1e-06", "anchor:metric=key", "multicut:cut=16"]
    labels = [ModeVariant.parse(s).namespace_label for s in specs]
    assert labels[2] == "halo:h_4:eps_1e-06"
    for label in labels:
        validate_namespace(f"bench-x-{label}-warmup")


@given(
    st.tuples(st.integers(0, 64), st.none() | st.floats(0, 1e6, allow_nan=False)),
    st.tuples(st.integers(0, 64), st.none() | st.floats(0, 1e6, allow_nan=False)),
)
def test_distinct_labels_never_share_a_namespace(a: tuple, b: tuple) -> None:
    first, second = (ModeVariant("halo", (("h", h), ("eps", eps))) for h, eps in (a, b))
    assert (first.label == second.label) == (first.namespace_label == second.namespace_label)


def test_policy_parameters_reach_the_built_policies() -> None:
    blend = ModeVariant.parse("blend:r=0.43").policy(FINGERPRINT)
    assert isinstance(blend, BlendPolicy) and blend.params.ratio == 0.43
    halo = ModeVariant.parse("halo:h=16").policy(FINGERPRINT)
    assert isinstance(halo, HaloPolicy) and halo.params.num_halo == 16
    assert halo.params.epsilon_nats is None
    accepting = ModeVariant.parse("halo:h=4+eps=0.05").policy(FINGERPRINT)
    assert isinstance(accepting, HaloPolicy)
    assert (accepting.params.num_halo, accepting.params.epsilon_nats) == (4, 0.05)
    anchor = ModeVariant.parse("anchor:gamma=0.5+tau=0.2+metric=key").policy(FINGERPRINT)
    assert isinstance(anchor, AnchorPolicy)
    params = anchor.params
    assert (params.gamma, params.tau, params.metric) == (0.5, 0.2, "key")
    assert params.repair_ratio is None
    repaired = ModeVariant.parse("anchor:gamma=1+r=0.15").policy(FINGERPRINT)
    assert isinstance(repaired, AnchorPolicy) and repaired.params.repair_ratio == 0.15
    assert repaired.params.min_coverage == 1.0  # KVComm's length rule unless asked
    covering = ModeVariant.parse("anchor:cover=0.5").policy(FINGERPRINT)
    assert isinstance(covering, AnchorPolicy) and covering.params.min_coverage == 0.5
    assert isinstance(ModeVariant.parse("dense").policy(FINGERPRINT), DensePolicy)


def test_multicut_cut_reuses_shallow_cuts_freely_and_deep_ones_only_on_identical_context() -> None:
    multicut = ModeVariant.parse("multicut:cut=16").policy(FINGERPRINT)
    assert isinstance(multicut, MulticutPolicy)
    assert multicut.w_exact == ExactWindow(((16, 0),))
    assert [multicut.w_exact(cut) for cut in (4, 16, 20, 28)] == [0, 0, "full", "full"]


def test_variants_override_the_base_policy_and_keep_the_rest() -> None:
    base = AdmissionPolicy(
        FINGERPRINT,
        params={
            "blend": blend_params(ratio=0.3),
            "halo": halo_params(num_halo=8),
            "anchor": anchor_params(gamma=0.7),
        },
    )
    blend = ModeVariant.parse("blend").policy(FINGERPRINT, base)
    assert isinstance(blend, BlendPolicy) and blend.params.ratio == 0.3
    halo = ModeVariant.parse("halo:eps=0.1").policy(FINGERPRINT, base)
    assert isinstance(halo, HaloPolicy) and halo.params.num_halo == 8
    assert halo.params.epsilon_nats == 0.1
    anchor = ModeVariant.parse("anchor:tau=0.5").policy(FINGERPRINT, base)
    assert isinstance(anchor, AnchorPolicy)
    assert (anchor.params.gamma, anchor.params.tau) == (0.7, 0.5)


def test_an_unknown_parameter_lists_what_the_mode_takes_with_ranges() -> None:
    with pytest.raises(ValueError, match="gamma: the gate's entropy threshold") as error:
        ModeVariant.parse("anchor:beta=1")
    assert "cover:" in str(error.value) and "0 ≤ x ≤ 1" in str(error.value)


def test_mask_takes_no_parameters_and_builds_its_policy() -> None:
    assert ModeVariant.parse("mask").policy(FINGERPRINT).mode == "mask"
    with pytest.raises(ValueError, match="takes no parameters"):
        ModeVariant.parse("mask:r=1")


def test_a_base_policy_of_another_model_is_refused() -> None:
    base = AdmissionPolicy(OTHER_FINGERPRINT)
    with pytest.raises(FingerprintMismatch, match=OTHER_FINGERPRINT):
        ModeVariant.parse("blend:r=0.2").policy(FINGERPRINT, base)
