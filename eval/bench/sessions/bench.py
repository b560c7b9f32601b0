"""`kvsplice bench sessions`: the trace replayed with session-aware retention and with today's
eviction, against Belady's optimum on the same accesses at the same capacity; hit rates (tokens)
and agent TTFT (`cost`). Returns the JSON document; the CLI prints and writes it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from kvsplice.common.config_flags import MIB
from kvsplice.eval.bench.sessions.belady import belady
from kvsplice.eval.bench.sessions.config import SessionBenchConfig
from kvsplice.eval.bench.sessions.cost import CostModel, cost_model
from kvsplice.eval.bench.sessions.replay import ReplayResult, ServedRequest, replay, temporary_dir
from kvsplice.eval.bench.sessions.trace import TraceRequest, build_trace

GOAL_OF_OPTIMUM = 0.9
GOAL_OVER_TODAY = 1.5


def run_session_bench(config: SessionBenchConfig) -> dict[str, Any]:
    trace = build_trace(config)
    costs = cost_model(config.cost_json, config.cost_tokens, config.cost_threads)
    document = compare(config, trace, costs)
    document["trace"] = trace_summary(config, trace, document.pop("num_distinct_chunks"))
    document["cost_model"] = asdict(costs)
    document["config"] = asdict(config)
    for lmdb_mib in config.sweep_lmdb_mib:
        swept = compare(replace(config, lmdb_bytes=lmdb_mib * MIB), trace, costs)
        document.setdefault("sweep", []).append({"lmdb_mib": lmdb_mib, **budget_summary(swept)})
    document["by_budget"] = sorted(
        [{"lmdb_mib": config.lmdb_bytes // MIB, **budget_summary(document)}, *document["sweep"]],
        key=lambda row: row["lmdb_mib"],
    )
    return document


def compare(
    config: SessionBenchConfig, trace: Sequence[TraceRequest], costs: CostModel
) -> dict[str, Any]:
    """Both replays and the optimum at this config's budgets."""
    runs: dict[str, ReplayResult] = {}
    for name, sessions in (("today", False), ("sessions", True)):
        with temporary_dir(config) as lmdb_dir:
            runs[name] = replay(config, trace, sessions, lmdb_dir)
    capacity = max(run.max_num_segments for run in runs.values())
    optimum = belady(runs["today"].chunk_keys, capacity)
    num_prompt_tokens = sum(s.num_prompt_tokens for s in runs["today"].served)
    optimum_tokens = optimum.num_hits * config.chunk_tokens
    policies = {name: policy_summary(run, costs) for name, run in runs.items()}
    hits = {name: policy["num_hit_tokens"] for name, policy in policies.items()}
    return {
        "policies": policies,
        "optimum": {
            "method": "Belady (furthest next use, with bypass) on the recorded chunk accesses",
            "capacity_chunks": capacity,
            "num_hit_tokens": optimum_tokens,
            "hit_rate": optimum_tokens / num_prompt_tokens,
            "num_prefix_hit_tokens": optimum.num_prefix_hits * config.chunk_tokens,
        },
        "goal": {
            "sessions_of_optimum": hits["sessions"] / optimum_tokens,
            "sessions_over_today": hits["sessions"] / max(hits["today"], 1),
            "optimum_over_today": optimum_tokens / max(hits["today"], 1),
            "met_of_optimum": hits["sessions"] >= GOAL_OF_OPTIMUM * optimum_tokens,
            "met_over_today": hits["sessions"] >= GOAL_OVER_TODAY * hits["today"],
        },
        "num_distinct_chunks": len({key for keys in runs["today"].chunk_keys for key in keys}),
    }


def budget_summary(compared: dict[str, Any]) -> dict[str, Any]:
    """One budget's line: the goal, each policy's hit rate and agent TTFT, the optimum's."""
    policies = compared["policies"]
    return {
        "goal": compared["goal"],
        "hit_rate": {name: policy["hit_rate"] for name, policy in policies.items()}
        | {"optimum": compared["optimum"]["hit_rate"]},
        "agent_ttft_s": {name: policy["agent_ttft_s"] for name, policy in policies.items()},
    }


def policy_summary(run: ReplayResult, costs: CostModel) -> dict[str, Any]:
    num_hit = sum(s.num_hit_tokens for s in run.served)
    num_prompt = sum(s.num_prompt_tokens for s in run.served)
    agents = [s for s in run.served if s.request.session_id is not None]
    roles = sorted({s.request.role for s in run.served})
    return {
        "num_hit_tokens": num_hit,
        "num_prompt_tokens": num_prompt,
        "hit_rate": num_hit / num_prompt,
        "agent_hit_rate": _hit_rate(agents),
        "agent_ttft_s": _ttft(agents, costs),
        "by_role": {
            role: {"hit_rate": _hit_rate(of), "ttft_s": _ttft(of, costs)}
            for role in roles
            if (of := [s for s in run.served if s.request.role == role])
        },
        "tier_hits": run.tier_hits,
        "removals": run.removals,
        "max_num_segments": run.max_num_segments,
        "max_live_sessions": run.max_live_sessions,
    }


def trace_summary(
    config: SessionBenchConfig, trace: Sequence[TraceRequest], num_distinct_chunks: int
) -> dict[str, Any]:
    spans: dict[str, list[float]] = {}
    for request in trace:
        if request.session_id is not None:
            spans.setdefault(request.session_id, []).append(request.time_s)
    live = [(min(times), max(times)) for times in spans.values()]
    total_kv = num_distinct_chunks * config.chunk_nbytes
    return {
        "num_requests": len(trace),
        "num_pipelines": len(live),
        "num_one_off_requests": sum(r.session_id is None for r in trace),
        "duration_s": trace[-1].time_s,
        "pipeline_duration_s_mean": statistics.fmean(end - start for start, end in live),
        "concurrent_pipelines_max": _max_overlap(live),
        "concurrent_pipelines_mean": _mean_overlap(
            live, min(e for _, e in live), max(s for s, _ in live)
        ),
        "concurrent_pipelines_mean_whole_trace": _mean_overlap(
            live, min(s for s, _ in live), max(e for _, e in live)
        ),
        "distinct_kv_bytes": total_kv,
        "kv_over_memory_plus_lmdb": total_kv / (config.memory_bytes + config.lmdb_bytes),
    }


def _hit_rate(served: Sequence[ServedRequest]) -> float:
    return sum(s.num_hit_tokens for s in served) / max(sum(s.num_prompt_tokens for s in served), 1)


def _ttft(served: Sequence[ServedRequest], costs: CostModel) -> dict[str, float]:
    times = sorted(costs.ttft_s(s.num_hit_tokens, s.num_prompt_tokens) for s in served)
    return {
        "mean": statistics.fmean(times),
        "p50": times[len(times) // 2],
        "p95": times[min(len(times) - 1, int(0.95 * len(times)))],
    }


def _max_overlap(spans: Sequence[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    live = best = 0
    for _, delta in events:
        live += delta
        best = max(best, live)
    return best


def _mean_overlap(spans: Sequence[tuple[float, float]], first: float, last: float) -> float:
    """Pipelines live on average in [first, last]: the steady state from the first end to the
    last start (the ramps before and after left out), or the whole trace."""
    covered = sum(max(0.0, min(end, last) - max(start, first)) for start, end in spans)
    return covered / max(last - first, 1e-9)
