"""CPU seconds per process group, as bench serve charges them to the store and the engines."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvsplice.eval.bench.process_cpu import cpu_s_per_request, group_cpu_s, groups_cpu_s
from kvsplice.eval.bench.serve.report import STORE, cpu_columns, fold_repeats

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"
# a parent that forks a burning child (as vLLM's API server forks its engine core), then waits
FORKING = (
    "import subprocess, sys\n"
    f"subprocess.run([sys.executable, '-c', {BURN.format(s=0.4)!r}], check=True)\n"
    "sys.stdin.read()\n"
)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="/proc (Linux)")
def test_a_group_s_cpu_counts_what_its_forked_processes_burn_and_no_other_group_s() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", FORKING], stdin=subprocess.PIPE, start_new_session=True
    )
    idle = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    try:
        before = groups_cpu_s({"burner": parent.pid, "idle": idle.pid})
        # the burning child exits after 0.4 s: read while it runs, then after
        samples = []
        for _ in range(200):
            samples.append(group_cpu_s(parent.pid))
            if samples[-1] is not None and samples[-1] - (before["burner"] or 0) >= 0.3:
                break
            time.sleep(0.01)
        after = groups_cpu_s({"burner": parent.pid, "idle": idle.pid})
        assert samples[-1] is not None and samples[-1] - before["burner"] >= 0.3  # type: ignore[operator]
        assert after["idle"] - before["idle"] < 0.1  # type: ignore[operator]
        per_request = cpu_s_per_request(before, after, 4)
        assert per_request["idle"] is not None and per_request["idle"] < 0.03
    finally:
        for child in (parent, idle):
            child.stdin.close()  # type: ignore[union-attr]
            child.wait(10)


def test_a_group_that_is_gone_counts_nothing() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    gone.wait()
    assert group_cpu_s(gone.pid) in (0.0, None)
    assert cpu_s_per_request({"x": None}, {"x": 1.0}, 3) == {"x": None}


def test_cpu_columns_split_the_store_from_both_engines_summed() -> None:
    cpu = {STORE: 0.02, "kvsplice-0": 0.5, "kvsplice-1": 0.25}
    assert cpu_columns(cpu) == {"store_cpu_s_per_request": 0.02, "engine_cpu_s_per_request": 0.75}
    assert cpu_columns({"recompute-0": 0.5, "recompute-1": 0.5}) == {
        "store_cpu_s_per_request": None, "engine_cpu_s_per_request": 1.0}  # fmt: skip
    assert cpu_columns({STORE: 0.1, "a": None, "b": 0.5})["engine_cpu_s_per_request"] is None


def test_repeats_fold_cpu_into_a_median_with_its_spread_and_leave_a_missing_store_alone() -> None:
    def row(repeat: int, engine_cpu: float, store_cpu: float | None) -> dict[str, object]:
        base: dict[str, object] = {key: 1.0 for key in (
            "ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "requests_per_s", "tokens_per_s",
            "hit_tokens", "local_hit_tokens", "external_hit_tokens", "prompt_tokens",
            "duration_s")}  # fmt: skip
        return {**base, "workload": "random", "concurrency": 16, "config": "c", "repeat": repeat,
                "num_requests": 32, "num_failed": 0, "load_avg_1m_before": 1.0,
                "load_avg_1m_after": 1.0, "engine_cpu_s_per_request": engine_cpu,
                "store_cpu_s_per_request": store_cpu}  # fmt: skip

    (folded,) = fold_repeats([row(0, 0.3, 0.01), row(1, 0.1, 0.03), row(2, 0.2, 0.02)])
    assert folded["engine_cpu_s_per_request"] == 0.2
    assert folded["spread"]["engine_cpu_s_per_request"] == [0.1, 0.3]
    assert folded["store_cpu_s_per_request"] == 0.02
    (no_store,) = fold_repeats([row(0, 0.3, None), row(1, 0.1, None)])
    assert no_store["store_cpu_s_per_request"] is None
    assert "store_cpu_s_per_request" not in no_store["spread"]
