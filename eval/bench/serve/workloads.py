"""`bench serve`'s three workloads as command lines of vLLM's own clients, and their results.

Owns each workload's sizes, the client invocation that runs it against one base URL
(`vllm.benchmarks.serve` for `prefix_repetition` and `random`, the sdist's
`benchmarks/multi_turn/benchmark_serving_multi_turn.py` for `multi_turn`) and reading
what the client wrote into one `ClientMetrics`. Knows nothing of engines or routing.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

WORKLOADS = ("prefix_repetition", "multi_turn", "random")
MULTI_TURN_SCRIPT = "multi_turn/benchmark_serving_multi_turn.py"


@dataclass(frozen=True)
class WorkloadShape:
    """Token counts of the three workloads, sized for a 2-core host.

    prefix_repetition: `num_prefixes` shared prefixes of `prefix_tokens`, each request
    adding a random suffix; random: `random_input_tokens` with nothing to share;
    multi_turn: ShareGPT conversations of `user_turns` user turns (messages of at most
    `max_content_chars`), answers of `answer_tokens` that the next turn carries.
    """

    prefix_tokens: int = 512
    suffix_tokens: int = 128
    num_prefixes: int = 4
    random_input_tokens: int = 640
    output_tokens: int = 32
    user_turns: int = 3
    answer_tokens: int = 128
    max_content_chars: int = 2000

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"{name} {value} must be >= 1")


@dataclass(frozen=True)
class ClientRun:
    """One client invocation: a workload at a concurrency against `base_url`."""

    workload: str
    concurrency: int
    num_requests: int
    seed: int
    base_url: str
    model_dir: str
    out_dir: Path
    conversations_path: Path | None = None  # multi_turn's input (vLLM's OpenAI format)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload {self.workload!r} not in {WORKLOADS}")
        if self.concurrency < 1 or self.num_requests < 1:
            raise ValueError(f"concurrency {self.concurrency} and num_requests "
                             f"{self.num_requests} must be >= 1")  # fmt: skip
        if (self.workload == "multi_turn") != (self.conversations_path is not None):
            raise ValueError("conversations_path goes with multi_turn, and only with it")

    @property
    def result_path(self) -> Path:
        return self.out_dir / "client-result.json"


@dataclass(frozen=True)
class ClientMetrics:
    """What a client measured: throughput over its whole run, latency percentiles."""

    num_requests: int
    num_failed: int
    duration_s: float
    requests_per_s: float
    tokens_per_s: float  # generated tokens
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p99_s: float


def client_command(run: ClientRun, shape: WorkloadShape, benchmarks_dir: Path) -> list[str]:
    if run.workload == "multi_turn":
        return _multi_turn_command(run, shape, benchmarks_dir)
    common = [
        sys.executable, "-m", "kvsplice.eval.bench.serve.client", "--base-url", run.base_url,
        "--model", run.model_dir, "--num-prompts", str(run.num_requests),
        "--max-concurrency", str(run.concurrency), "--seed", str(run.seed),
        "--temperature", "0", "--ignore-eos", "--disable-tqdm",
        # The engines are up; its ready check would send one prompt of the run early.
        "--ready-check-timeout-sec", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(run.out_dir),
        "--result-filename", run.result_path.name,
    ]  # fmt: skip
    if run.workload == "random":
        return [*common, "--dataset-name", "random",
                "--random-input-len", str(shape.random_input_tokens),
                "--random-output-len", str(shape.output_tokens)]  # fmt: skip
    return [*common, "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(shape.prefix_tokens),
            "--prefix-repetition-suffix-len", str(shape.suffix_tokens),
            "--prefix-repetition-num-prefixes", str(shape.num_prefixes),
            "--prefix-repetition-output-len", str(shape.output_tokens)]  # fmt: skip


def _multi_turn_command(run: ClientRun, shape: WorkloadShape, benchmarks_dir: Path) -> list[str]:
    script = benchmarks_dir / MULTI_TURN_SCRIPT
    if not script.is_file():
        raise ValueError(f"{script} is missing: `python scripts/fetch_vllm_tests.py "
                         "benchmarks` unpacks it (make vllm does)")  # fmt: skip
    return [
        sys.executable, str(script), "--input-file", str(run.conversations_path),
        "--model", run.model_dir, "--url", run.base_url,
        "--num-clients", str(run.concurrency), "--seed", str(run.seed),
        # Both limits or neither (its rule); only max_tokens reaches the server.
        "--limit-max-tokens", str(shape.answer_tokens),
        "--limit-min-tokens", str(shape.answer_tokens),
        # Every conversation to its end: its default stops all once one client runs dry.
        "--no-early-stop", "--request-timeout-sec", "1800",
        "--stats-json-output", str(run.result_path),
    ]  # fmt: skip


def num_conversations(num_requests: int, concurrency: int, shape: WorkloadShape) -> int:
    """Conversations for about `num_requests` turns; each of the client's processes needs one."""
    return max(concurrency, math.ceil(num_requests / shape.user_turns))


def read_metrics(run: ClientRun) -> ClientMetrics:
    data = json.loads(run.result_path.read_text())
    if run.workload == "multi_turn":
        return multi_turn_metrics(data)
    return serve_metrics(data)


def serve_metrics(result: dict[str, Any]) -> ClientMetrics:
    """From `vllm.benchmarks.serve`'s saved result (`--metric-percentiles 50,99`)."""
    return ClientMetrics(
        num_requests=int(result["completed"]),
        num_failed=int(result["failed"]),
        duration_s=float(result["duration"]),
        requests_per_s=float(result["request_throughput"]),
        tokens_per_s=float(result["output_throughput"]),
        ttft_p50_s=result["p50_ttft_ms"] / 1000,
        ttft_p99_s=result["p99_ttft_ms"] / 1000,
        tpot_p99_s=result["p99_tpot_ms"] / 1000,
    )


def multi_turn_metrics(stats: list[dict[str, Any]]) -> ClientMetrics:
    """From the multi-turn client's per-request stats (`--stats-json-output`): its own
    runtime (first start to last end), percentiles as `vllm.benchmarks.serve` takes them.
    Failed requests leave no stats there (the router counts them), and the client's main
    process can miss a process's last result (it drains a multiprocessing queue while
    `empty()`), so `num_requests` may fall one or two short of the turns sent."""
    if not stats:
        raise ValueError("the multi-turn client recorded no request")
    starts = np.array([s["start_time_ms"] for s in stats])
    ends = starts + np.array([s["latency_ms"] for s in stats])
    duration_s = float(ends.max() - starts.min()) / 1000
    ttfts = np.array([s["ttft_ms"] for s in stats]) / 1000
    tpots = np.array([s["tpot_ms"] for s in stats]) / 1000
    return ClientMetrics(
        num_requests=len(stats),
        num_failed=0,
        duration_s=duration_s,
        requests_per_s=len(stats) / duration_s,
        tokens_per_s=sum(s["output_num_tokens"] for s in stats) / duration_s,
        ttft_p50_s=float(np.percentile(ttfts, 50)),
        ttft_p99_s=float(np.percentile(ttfts, 99)),
        tpot_p99_s=float(np.percentile(tpots, 99)),
    )
