"""Which engines give approximate runs: the admission policy, read at the engine's start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsplice.common.errors import FingerprintMismatch
from kvsplice.integrations.vllm.reuse_policy import SHIPPED_DIR, admits_spans

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


def test_the_shipped_policies_are_found_and_admit_no_naive() -> None:
    shipped = sorted(SHIPPED_DIR.glob("kvfp1-*.json"))
    assert shipped, f"no shipped policies under {SHIPPED_DIR}"
    for path in shipped:
        assert admits_spans(None, path.stem) is False  # judges only (crossfix), see docs


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
