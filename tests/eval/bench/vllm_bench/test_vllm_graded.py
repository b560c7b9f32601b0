"""`bench vllm --problems`: grading a pipeline's answers, and the bench's graded runs wired
through a scripted engine (no vLLM: what the engines answer is set here)."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvsplice.eval.bench.vllm import bench as vllm_bench
from kvsplice.eval.bench.vllm.config import VllmBenchConfig
from kvsplice.eval.bench.vllm.engine import Completion
from kvsplice.eval.bench.vllm.graded import (
    GRADED,
    GradedRun,
    grade_run,
    paired_difference,
    pool,
    summarize,
    wilson,
)
from kvsplice.eval.bench.vllm.printing import print_report
from kvsplice.eval.workloads.graded_pipelines import PIPELINES
from kvsplice.eval.workloads.token_transcript import PIPELINE_ROLES
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
    return grade_run(PIPELINES["humaneval"], PROBLEM, texts, outputs or [(i,) for i in range(5)])


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
        grade_run(PIPELINES["humaneval"], PROBLEM, ["a", "b"], [(1,), (2,)])


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
    assert set(summary["roles"]) == {*GRADED, "all"}
    pooled = summary["roles"]["all"]  # 6 answers: 2 right here, 4 there; 1 here only, 3 there
    assert (pooled["right"], pooled["n"], pooled["right_only_here"]) == (2, 6, 1)
    assert pooled["right_only_recompute"] == 3
    assert pooled["vs_recompute_points"] == pytest.approx(100 * (2 - 4) / 6)
    low, high = pooled["vs_recompute_ci95_points"]
    assert low < pooled["vs_recompute_points"] < high
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


def _warm_graded_runs(
    engine: object,
    problems: list[Problem],
    config: VllmBenchConfig,
    monkeypatch: pytest.MonkeyPatch,
) -> list[GradedRun]:
    """The bench's warm graded runs of `problems` on the one fake `engine`, never settling."""
    monkeypatch.setattr(vllm_bench, "SETTLE_S", 0.0)
    setup = vllm_bench._Setup([engine])  # type: ignore[list-item]
    return vllm_bench._graded_runs(setup, _Tokenizer(), problems, "warm", config)


def test_graded_runs_grade_each_problem_after_one_warm_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _Engine(_texts(RIGHT, WRONG, "FAIL: wrong sign"))
    config = VllmBenchConfig(
        out_json=tmp_path / "r.json", layout="persona-first", answer_tokens=64, problems=(0, 1)
    )
    runs = _warm_graded_runs(engine, [PROBLEM, PROBLEM], config, monkeypatch)
    assert [r.right for r in runs] == [{"solver": True, "reviser": False, "judge": True}] * 2
    assert len(engine.requests) == 15  # the warm-up pipeline, then one per problem
    assert {r["cache_salt"] for r in engine.requests} == {vllm_bench.GRADED_SALT}
    assert {(r["max_tokens"], r["min_tokens"]) for r in engine.requests} == {(64, 0)}
    assert runs[0].cached_tokens == (0,) * 5 and len(runs[0].prompt_tokens) == 5
    assert runs[0].as_json()["prompt_tokens"] == list(runs[0].prompt_tokens)
    assert runs[0].as_json()["answers"]["solver"] == RIGHT  # what the grade was given
    assert runs[0].as_json()["ttft_s"] == [0.01] * 5  # each agent's, as its engine timed it


class _RoleEngine:
    """Answers by the role whose instruction ends the prompt (the problem's name picks
    right or wrong code), slowly, from any thread; records how many requests overlap."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = 0

    def complete(self, prompt_ids: list[int], **request: Any) -> Completion:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(0.02)
        text = "".join(chr(i) for i in prompt_ids)
        role = max(PIPELINE_ROLES, key=lambda r: text.rfind(r[1]))[0]
        code = WRONG if "def sub(" in text else RIGHT
        answer = {"solver": code, "reviser": code, "judge": "PASS"}.get(role, "notes")
        with self.lock:
            self.in_flight -= 1
        return Completion(tuple(ord(c) for c in answer), 0.01, 0.02, len(prompt_ids), 0)


def test_concurrent_graded_runs_overlap_and_come_back_in_problem_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _RoleEngine()
    config = VllmBenchConfig(
        out_json=tmp_path / "r.json", layout="persona-first", answer_tokens=64,
        problems=(0, 1, 2, 3), concurrency=4,
    )  # fmt: skip
    other = replace(PROBLEM, problem_id="Toy/1", question='def sub(a, b):\n    """a + b"""\n')
    problems = [PROBLEM, other, PROBLEM, other]
    runs = _warm_graded_runs(engine, problems, config, monkeypatch)
    assert [r.problem_id for r in runs] == ["Toy/0", "Toy/1", "Toy/0", "Toy/1"]
    assert [r.right["solver"] for r in runs] == [True, False, True, False]
    assert [r.right["judge"] for r in runs] == [True, False, True, False]  # PASS on wrong code
    assert engine.most_in_flight > 1
    with pytest.raises(ValueError, match="concurrency"):
        VllmBenchConfig(out_json=tmp_path / "r.json", concurrency=0)


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
    print_report(report, console)
    text = console.export_text()
    assert "graded answers" in text and "0/1" in text and "TTFT per agent" not in text


def test_repeats_zero_needs_problems(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="0 only with --problems"):
        VllmBenchConfig(out_json=tmp_path / "r.json", repeats=0)


def test_paired_difference_is_wald_for_many_pairs_and_honest_for_few() -> None:
    both, here, there, neither = 500, 100, 80, 320  # large n: the Wald interval's
    n = both + here + there + neither
    centre = (here - there) / n
    half = 1.96 * math.sqrt((here + there) / n**2 - (here - there) ** 2 / n**3)
    low, high = paired_difference(both, here, there, neither)
    assert low == pytest.approx(centre - half, abs=1e-3)
    assert high == pytest.approx(centre + half, abs=1e-3)
    # every answer alike: 0 is inside, and more pairs bound the difference closer to it
    few, many = paired_difference(3, 0, 0, 11), paired_difference(30, 0, 0, 110)
    assert few[0] < 0 < few[1] and many[0] < 0 < many[1]
    assert few[1] - few[0] > many[1] - many[0]
    # one discordant answer each way: symmetric about 0
    low, high = paired_difference(16, 1, 1, 24)
    assert low == pytest.approx(-high) and high > 0.02
    # the interval never leaves [-1, 1], and covers everything for no pairs
    assert paired_difference(0, 5, 0, 0)[1] <= 1.0
    assert paired_difference(0, 0, 0, 0) == (-1.0, 1.0)
    with pytest.raises(ValueError, match="negative"):
        paired_difference(1, -1, 0, 0)


def _graded_report(
    tmp_path: Path, name: str, solvers: dict[str, str], dtype: str = "float32"
) -> Path:
    """A `bench vllm --problems` report: recompute's solvers right, gated's as given."""
    config = VllmBenchConfig(
        out_json=tmp_path / f"{name}.json", configs=("recompute", "kvsplice-gated"),
        repeats=0, problems=tuple(range(len(solvers))), prefix_caching=("on",), dtype=dtype,
    )  # fmt: skip
    results = []
    for config_name in ("recompute", "kvsplice-gated"):
        result = vllm_bench.ConfigResult(config_name, config_name != "recompute")
        result.graded_runs = [
            replace(_run(RIGHT if config_name == "recompute" else solver, WRONG, "FAIL"),
                    problem_id=problem, ttft_s=(0.1, 0.2, 0.3, 0.4, 0.5 + i))
            for i, (problem, solver) in enumerate(solvers.items())
        ]  # fmt: skip
        vllm_bench._summarize(result)
        results.append(result)
    vllm_bench._write(config, results)
    assert config.out_json is not None
    return config.out_json


def test_pooled_reports_add_up_to_one_summary(tmp_path: Path) -> None:
    first = _graded_report(tmp_path, "a", {"P/1": RIGHT, "P/2": WRONG})
    second = _graded_report(tmp_path, "b", {"P/3": RIGHT})
    pooled = pool([json.loads(first.read_text()), json.loads(second.read_text())])
    assert (pooled["problems"], pooled["reports"]) == (3, 2)
    gated = next(row for row in pooled["configs"] if row["label"].startswith("kvsplice-gated"))
    solver = gated["graded"]["roles"]["solver"]
    assert (solver["right"], solver["n"], solver["right_only_recompute"]) == (2, 3, 1)
    assert gated["graded"]["roles"]["all"]["n"] == 9
    assert [run["problem"] for run in gated["graded"]["runs"]] == ["P/1", "P/2", "P/3"]
    assert gated["graded"]["outputs"] == 15  # 5 agents x 3 problems, added up
    assert gated["graded"]["agent5_ttft_s"] == 0.5  # the median of 0.5, 1.5 and 0.5
    with pytest.raises(ValueError, match="graded twice"):
        pool([json.loads(first.read_text())] * 2)
    other = _graded_report(tmp_path, "c", {"P/4": RIGHT}, dtype="bfloat16")
    with pytest.raises(ValueError, match="differ in dtype"):
        pool([json.loads(first.read_text()), json.loads(other.read_text())])
    with pytest.raises(ValueError, match="no reports"):
        pool([])


def test_bench_vllm_graded_pools_files_and_names_a_bad_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvsplice.cli import main

    first = _graded_report(tmp_path, "a", {"P/1": RIGHT, "P/2": WRONG})
    second = _graded_report(tmp_path, "b", {"P/3": RIGHT})
    out_json = tmp_path / "pooled.json"
    with pytest.raises(SystemExit) as exited:
        main(["bench", "vllm-graded", str(first), str(second), "--json", str(out_json)])
    assert exited.value.code in (0, None)
    out = capsys.readouterr().out
    assert "graded answers" in out and "2/3" in out and "3 problems from 2 reports" in out
    assert json.loads(out_json.read_text())["files"] == [str(first), str(second)]
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(SystemExit) as exited:
        main(["bench", "vllm-graded", str(first), str(broken)])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert "cannot pool" in err and "broken.json" in err and "Traceback" not in err


class _McEngine:
    """MMLU's pipeline scripted: the solver answers B (right), the reviser C, the judge B;
    every answer but the judge's runs to the token cap."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    def complete(self, prompt_ids: list[int], **request: Any) -> Completion:
        from kvsplice.eval.workloads.graded_pipelines import PIPELINES as pipelines

        self.requests.append(request)
        text = "".join(chr(i) for i in prompt_ids)
        roles = pipelines["mmlu"].instructions
        role = max(roles, key=lambda r: text.rfind(r[1]))[0]
        answer = {"solver": "Answer: B", "reviser": "Answer: C", "judge": "Answer: B"}.get(
            role, "n"
        )
        ids = tuple(ord(c) for c in answer)
        if role != "judge":
            ids = (ids + (32,) * request["max_tokens"])[: request["max_tokens"]]
        return Completion(ids, 0.01, 0.02, len(prompt_ids), 7)


def test_an_mmlu_workload_grades_letters_its_judge_between_candidates_and_truncation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _McEngine()
    config = VllmBenchConfig(
        out_json=tmp_path / "r.json", layout="persona-first", answer_tokens=32, problems=(7,),
        workload="mmlu", repeats=0,
    )  # fmt: skip
    problem = Problem("mmlu-test-7", "Q?\nA. a\nB. b\nC. c\nD. d", "B")
    (run,) = _warm_graded_runs(engine, [problem], config, monkeypatch)
    assert run.right == {"solver": True, "reviser": False, "judge": True} and run.judge_graded
    assert run.verdict == "B"
    assert run.as_json()["truncated"] == {
        "planner": True, "solver": True, "critic": True, "reviser": True, "judge": False
    }  # fmt: skip
    with pytest.raises(ValueError, match="mmlu has 14042"):
        VllmBenchConfig(
            out_json=tmp_path / "r.json", problems=(14_042,), workload="mmlu", repeats=0
        )
    with pytest.raises(ValueError, match="--repeats 0"):
        VllmBenchConfig(out_json=tmp_path / "r.json", problems=(1,), workload="mmlu")
    assert VllmBenchConfig(
        out_json=tmp_path / "r.json", configs=("recompute", "control-unrotated", "control-noise"),
        problems=(1,), workload="gsm8k", repeats=0,
    ).configs[1:] == ("control-unrotated", "control-noise")  # fmt: skip
