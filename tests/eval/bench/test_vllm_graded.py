"""`bench vllm --problems`: grading a pipeline's answers, and the bench's graded runs wired
through a scripted engine (no vLLM: what the engines answer is set here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvsplice.eval.bench import vllm_bench
from kvsplice.eval.bench.vllm_bench_config import VllmBenchConfig
from kvsplice.eval.bench.vllm_engine import Completion
from kvsplice.eval.bench.vllm_graded import GRADED, grade_run, summarize, wilson
from kvsplice.eval.workloads.workload import Problem

PROBLEM = Problem(
    "Toy/0",
    'def add(a, b):\n    """a + b"""\n',
    extras={
        "prompt": 'def add(a, b):\n    """a + b"""\n',
        "test": "def check(f):\n    assert f(2, 3) == 5\n    assert f(-1, 1) == 0\n",
        "entry_point": "add",
    },
)
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"


def _texts(solver: str, reviser: str, judge: str) -> list[str]:
    return ["1. add them", solver, "looks fine", reviser, judge]


def _run(solver: str, reviser: str, judge: str, outputs: Any = None):  # type: ignore[no-untyped-def]
    texts = _texts(solver, reviser, judge)
    return grade_run(PROBLEM, texts, outputs or [(i,) for i in range(5)])


def test_code_answers_are_run_against_the_tests_and_the_verdict_against_the_reviser() -> None:
    run = _run(RIGHT, WRONG, "FAIL: it subtracts.")
    assert run.right == {"solver": True, "reviser": False, "judge": True}
    assert run.verdict == "FAIL"
    run = _run(WRONG, RIGHT, "FAIL, because ...")
    assert run.right == {"solver": False, "reviser": True, "judge": False}
    assert _run(WRONG, RIGHT, "I cannot say.").right["judge"] is False  # no verdict: wrong
    assert _run(WRONG, RIGHT, "PASSING grade").verdict is None  # a word, not a prefix


def test_a_run_needs_every_agents_answer() -> None:
    with pytest.raises(ValueError, match="5 answers"):
        grade_run(PROBLEM, ["a", "b"], [(1,), (2,)])


def test_wilson_interval() -> None:
    low, high = wilson(15, 20)
    assert (round(low, 3), round(high, 3)) == (0.531, 0.888)  # the 75% of 20 quoted in docs
    assert wilson(0, 0) == (0.0, 1.0)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0
    with pytest.raises(ValueError):
        wilson(3, 2)


def test_summary_against_recompute_counts_paired_differences() -> None:
    ref = [_run(RIGHT, RIGHT, "PASS"), _run(WRONG, WRONG, "FAIL")]
    here = [_run(RIGHT, WRONG, "PASS", [(9,), (1,), (2,), (3,), (4,)]), _run(WRONG, RIGHT, "FAIL")]
    summary = summarize(here, ref)
    reviser = summary["roles"]["reviser"]
    assert (reviser["right"], reviser["n"], reviser["vs_recompute_points"]) == (1, 2, 0.0)
    assert (reviser["right_only_here"], reviser["right_only_recompute"]) == (1, 1)
    assert summary["roles"]["judge"]["right"] == 0  # both verdicts contradict the tests
    assert summary["roles"]["judge"]["vs_recompute_points"] == -100.0
    assert (summary["outputs_equal_recompute"], summary["outputs"]) == (9, 10)
    assert set(summary["roles"]) == set(GRADED)
    with pytest.raises(ValueError, match="different problems"):
        summarize(here[:1], ref)


class _Tokenizer:
    """Characters as tokens; a chat template that joins the messages."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return "\n".join(m["content"] for m in messages)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class _Engine:
    """Answers each role as scripted; records every request."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers
        self.requests: list[dict[str, Any]] = []

    def complete(self, prompt_ids: list[int], **request: Any) -> Completion:
        self.requests.append(request)
        text = self.answers[(len(self.requests) - 1) % len(self.answers)]
        ids = tuple(ord(c) for c in text)
        return Completion(ids, 0.01, 0.02, len(prompt_ids), 0)


def test_graded_runs_grade_each_problem_after_one_warm_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_bench, "SETTLE_S", 0.0)
    engine = _Engine(_texts(RIGHT, WRONG, "FAIL: wrong sign"))
    setup = vllm_bench._Setup([engine])  # type: ignore[list-item]
    config = VllmBenchConfig(
        out_json=tmp_path / "r.json", layout="persona-first", answer_tokens=64, problems=(0, 1)
    )
    runs = vllm_bench._graded_runs(setup, _Tokenizer(), [PROBLEM, PROBLEM], "warm", config)
    assert [r.right for r in runs] == [{"solver": True, "reviser": False, "judge": True}] * 2
    assert len(engine.requests) == 15  # the warm-up pipeline, then one per problem
    assert {r["cache_salt"] for r in engine.requests} == {vllm_bench.GRADED_SALT}
    assert {(r["max_tokens"], r["min_tokens"]) for r in engine.requests} == {(64, 0)}
    assert runs[0].cached_tokens == (0,) * 5 and len(runs[0].prompt_tokens) == 5
    assert runs[0].as_json()["prompt_tokens"] == list(runs[0].prompt_tokens)


def test_problems_flag_rejects_repeats(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="repeat"):
        VllmBenchConfig(out_json=tmp_path / "r.json", problems=(3, 3))


def test_a_graded_only_report_is_written_and_printed(tmp_path: Path) -> None:
    from rich.console import Console

    config = VllmBenchConfig(
        out_json=tmp_path / "r.json", configs=("recompute", "kvsplice-gated"), repeats=0,
        problems=(0,), prefix_caching=("on",),
    )  # fmt: skip
    results = []
    for name, solver in (("recompute", RIGHT), ("kvsplice-gated", WRONG)):
        result = vllm_bench.ConfigResult(name, name != "recompute")
        result.graded_runs = [_run(solver, RIGHT, "PASS")]
        vllm_bench._summarize(result)
        results.append(result)
    report = vllm_bench._write(config, results)
    gated = report["configs"][1]["graded"]["roles"]
    assert (gated["solver"]["right"], gated["solver"]["vs_recompute_points"]) == (0, -100.0)
    console = Console(record=True, width=200)
    vllm_bench.print_report(report, console)
    text = console.export_text()
    assert "graded answers" in text and "0/1" in text and "TTFT per agent" not in text


def test_repeats_zero_needs_problems(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="0 only with --problems"):
        VllmBenchConfig(out_json=tmp_path / "r.json", repeats=0)
