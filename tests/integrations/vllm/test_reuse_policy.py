"""Which engines give approximate runs: the admission policy, read at the engine's start."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvsplice.common.errors import FingerprintMismatch
from kvsplice.common.reuse_modes import SHIPPED_DIR
from kvsplice.integrations.vllm.reuse_policy import admits_spans

FINGERPRINT = "kvfp1-" + "ef" * 16


def write(tmp_path: Path, **document: object) -> str:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"format_version": 2, "model_fingerprint": FINGERPRINT, **document}))
    return str(path)


def test_only_a_policy_admitting_naive_gives_approximate_runs(tmp_path: Path) -> None:
    assert admits_spans(write(tmp_path, admitted_modes=["dense", "exact", "naive"]), FINGERPRINT)
    assert not admits_spans(
        write(tmp_path, admitted_modes=["dense", "exact", "blend"]), FINGERPRINT
    )
    assert not admits_spans(None, FINGERPRINT)  # nothing shipped for it: the safe default


def test_no_shipped_policy_admits_an_approximate_mode_for_engines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Until the graded yardstick admits a mode (issue 50), every engine finds exact reuse
    only, and its start line says why."""
    from kvsplice.client.modes.admission import AdmissionPolicy

    shipped = sorted(SHIPPED_DIR.glob("kvfp1-*.json"))
    assert shipped, f"no shipped policies under {SHIPPED_DIR}"
    for path in shipped:
        policy = AdmissionPolicy.from_json(path.read_text())
        assert policy.model_fingerprint == path.stem
        assert "naive" not in policy.admitted_modes, path  # the HF worker's: crossfix for judges
        assert not admits_spans(None, path.stem)
    with caplog.at_level("INFO"):
        assert not admits_spans(None, FINGERPRINT)
    assert "none admits an approximate mode until the graded yardstick" in caplog.text


def test_a_wrong_or_missing_policy_stops_the_engine_with_a_clear_error(tmp_path: Path) -> None:
    other = write(tmp_path, admitted_modes=["dense", "exact", "naive"])
    with pytest.raises(FingerprintMismatch, match="not kvfp1-"):
        admits_spans(other, "kvfp1-" + "00" * 16)
    with pytest.raises(FileNotFoundError):
        admits_spans(str(tmp_path / "missing.json"), FINGERPRINT)
    (tmp_path / "junk.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not an admission policy"):
        admits_spans(str(tmp_path / "junk.json"), FINGERPRINT)
    with pytest.raises(ValueError, match="admitted_modes"):
        admits_spans(write(tmp_path, admitted_modes="naive"), FINGERPRINT)


def test_engines_serving_qwen_find_no_policy_admitting_naive() -> None:
    """Engines serving the packaged Qwen2.5-Coder-0.5B (the fingerprint from vLLM's own model
    config) find no policy admitting naive, in float32 (where one shipped until issue 50)
    or bf16."""
    pytest.importorskip("vllm", reason="vLLM computes what an engine serves (make vllm)")
    from kvsplice.eval.bench.vllm.admission import served_fingerprint

    qwen = os.environ.get("KVSPLICE_VLLM_QWEN_DIR")
    if not qwen:  # make test sets it (the packaged Qwen converted by .venv's `make qwen`)
        pytest.skip("KVSPLICE_VLLM_QWEN_DIR: kvsplice model-dir --model qwen2.5-coder-0.5b")
    assert served_fingerprint(qwen, "float32") == "kvfp1-d6491609abde928f77d798710c8f92b0"
    assert not admits_spans(None, served_fingerprint(qwen, "float32"))
    assert not admits_spans(None, served_fingerprint(qwen, "bfloat16"))


def test_gated_runs_the_first_engine_mode_in_the_policy_s_order(tmp_path: Path) -> None:
    """One vocabulary (`common.reuse_modes`): the connector reads the policy with the HF
    worker's parser and keeps the modes it runs in the policy's order."""
    from kvsplice.integrations.vllm.reuse_policy import admitted_engine_modes
    from kvsplice.integrations.vllm.reuse_request import RequestedReuse

    both = write(tmp_path, admitted_modes=["dense", "exact", "anchor", "blend", "naive"])
    modes = admitted_engine_modes(both, FINGERPRINT)
    assert modes == ("anchor", "naive")
    assert RequestedReuse("gated").engine_mode(modes) == "anchor"
    assert RequestedReuse("anchor").engine_mode(("naive",)) is None  # not admitted: exact
    assert RequestedReuse("exact").engine_mode(modes) is None
    version_1 = tmp_path / "v1.json"
    version_1.write_text(json.dumps({"format_version": 1, "model_fingerprint": FINGERPRINT,
                                     "admitted_modes": ["dense", "naive"], "anchor_gamma": 0.5}))  # fmt: skip
    assert admitted_engine_modes(str(version_1), FINGERPRINT) == ("naive",)
