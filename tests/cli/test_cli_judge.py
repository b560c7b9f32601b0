"""`kvsplice bench judge`: its choices are the library's, and bad settings fail before the model."""

from __future__ import annotations

import pytest
from test_bench_flag_names import options
from test_cli_errors import one_error_line, run_cli

from kvsplice.agents.judge import JUDGE_LAYOUTS, REGIMES
from kvsplice.agents.judge_prompts import TASKS


def test_the_choices_are_the_library_choices() -> None:
    choices = {
        p.opts[0]: tuple(choice.value for choice in p.type_descriptor.annotation)
        for p in options(("bench", "judge"))
        if p.opts[0] in ("--task", "--regime", "--layout")
    }
    assert choices == {"--task": TASKS, "--regime": REGIMES, "--layout": JUDGE_LAYOUTS}


def test_help_names_the_issue_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["bench", "judge", "-h"], capsys)
    assert code == 0
    for flag in ("--task", "--regime", "--candidates", "--shuffle / --no-shuffle", "--modes",
                 "--seed", "--policy", "--json", "--data", "--layout"):  # fmt: skip
        assert flag in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--modes", "dense,bogus"], "unknown mode"),
        (["--candidates", "9"], "--candidates"),
        (["--task", "math"], "--task"),
    ],
)
def test_bad_settings_fail_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    code, _, err = run_cli(["bench", "judge", *argv], capsys)
    assert code == 2
    assert message in one_error_line(err)


def test_gated_needs_the_risk_gate_in_this_build(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    from kvsplice.client.modes.registry import MODES

    if "gated" in MODES:
        pytest.skip("this build has the risk gate")
    code, _, err = run_cli(["bench", "judge", "--modes", "dense,gated"], capsys)
    assert code == 2 and "risk gate" in one_error_line(err)
