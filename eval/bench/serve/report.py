"""`bench serve`'s JSON rows and table: one row per run, medians when runs repeat.

Owns the row contract (`ROW_KEYS`, names of workloads and configurations as given),
the definition of hit tokens, folding repeats into a median with its spread, and the
printed table. Knows nothing of engines or clients.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from kvsplice.eval.bench.serve.workloads import ClientMetrics

# The contract: every row of "runs" has these keys (and may have more).
ROW_KEYS = (
    "workload", "concurrency", "config", "ttft_p50_s", "ttft_p99_s", "tpot_p99_s",
    "requests_per_s", "hit_tokens",
)  # fmt: skip
HIT_TOKENS = (
    "prompt tokens not computed by the engine that served them: found in its own prefix "
    "cache or loaded through its KV connector. Summed over both engines from vLLM's "
    "Prometheus counter vllm:prompt_tokens_cached (the increase over the run); "
    "local_hit_tokens and external_hit_tokens split it by vllm:prompt_tokens_by_source "
    "(local_cache_hit, external_kv_transfer), prompt_tokens is vllm:prompt_tokens."
)
# Row key -> counter name as `Engine.counters(split_by="source")` reports it.
HIT_COUNTERS = {
    "hit_tokens": "vllm:prompt_tokens_cached_total",
    "local_hit_tokens": "vllm:prompt_tokens_by_source_total[local_cache_hit]",
    "external_hit_tokens": "vllm:prompt_tokens_by_source_total[external_kv_transfer]",
    "prompt_tokens": "vllm:prompt_tokens_total",
}
# Measured per run; a repeated run reports their median and [min, max] (a key that is
# None in any of them, as the store's CPU without a store, is left as the first run's).
MEASURED = (
    "ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "requests_per_s", "tokens_per_s", "hit_tokens",
    "local_hit_tokens", "external_hit_tokens", "prompt_tokens", "duration_s",
    "store_cpu_s_per_request", "engine_cpu_s_per_request",
)  # fmt: skip
STORE = "store"  # the store's process group in a run's `cpu_s_per_request` (the engines' by name)


def cpu_columns(cpu: Mapping[str, float | None]) -> dict[str, float | None]:
    """A run's CPU seconds per request (`process_cpu`, by process group) as two row keys:
    the store's (sidecar or LMCache server; None without one) and both engines' summed."""
    engines = [value for name, value in cpu.items() if name != STORE]
    summed = None if not engines or None in engines else sum(v for v in engines if v is not None)
    return {"store_cpu_s_per_request": cpu.get(STORE), "engine_cpu_s_per_request": summed}


def hit_token_deltas(
    before: Sequence[Mapping[str, float]], after: Sequence[Mapping[str, float]]
) -> dict[str, int]:
    """The increase of each `HIT_COUNTERS` counter, summed over engines (one mapping each)."""
    return {
        key: round(
            sum(a.get(name, 0.0) - b.get(name, 0.0) for b, a in zip(before, after, strict=True))
        )
        for key, name in HIT_COUNTERS.items()
    }


def run_row(
    identity: Mapping[str, Any],
    metrics: ClientMetrics,
    hits: Mapping[str, int],
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """One run's row: `identity` (workload, concurrency, config, repeat), the client's
    metrics, the hit tokens and anything else measured (`extra`)."""
    row = {**identity, **asdict(metrics), **hits, **extra}
    missing = [key for key in ROW_KEYS if key not in row]
    if missing:
        raise ValueError(f"a run row lacks {missing}")
    return row


def fold_repeats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (workload, concurrency, config), in first-seen order: a single run as it
    is; repeats as the median of each `MEASURED` key, `spread` its [min, max], `repeats`
    their number, the highest load average seen."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["workload"], row["concurrency"], row["config"]), []).append(row)
    return [_fold(group) for group in groups.values()]


def _fold(group: list[dict[str, Any]]) -> dict[str, Any]:
    folded = {k: v for k, v in group[0].items() if k != "repeat"}
    folded["repeats"] = len(group)
    if len(group) == 1:
        return folded
    for key in MEASURED:
        if any(row.get(key) is None for row in group):
            continue
        values = [row[key] for row in group]
        folded[key] = statistics.median(values)
        folded.setdefault("spread", {})[key] = [min(values), max(values)]
    for key in ("num_requests", "num_failed"):
        folded[key] = sum(row[key] for row in group)
    for key in ("load_avg_1m_before", "load_avg_1m_after"):
        folded[key] = max(row[key] for row in group)
    return folded


def print_table(report: Mapping[str, Any], console: Any) -> None:
    from kvsplice.eval.report.tables import figures_table

    columns = ("workload", "conc", "config", "req/s", "tok/s", "TTFT p50", "TTFT p99",
               "TPOT p99", "hit tok", "hit %", "failed", "CPU s/req eng", "store", "load")  # fmt: skip
    title = "bench serve: vLLM's clients, two engines behind a router (s; medians of repeats)"
    table = figures_table(columns, ("workload", "config"), title=title)
    for row in report["runs"]:
        share = row["hit_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
        table.add_row(
            row["workload"], str(row["concurrency"]), row["config"],
            f"{row['requests_per_s']:.2f}", f"{row['tokens_per_s']:.1f}",
            f"{row['ttft_p50_s']:.3f}", f"{row['ttft_p99_s']:.3f}", f"{row['tpot_p99_s']:.4f}",
            str(row["hit_tokens"]), f"{100 * share:.0f}", str(row["num_failed"]),
            _seconds(row.get("engine_cpu_s_per_request")),
            _seconds(row.get("store_cpu_s_per_request")), f"{row['load_avg_1m_after']:.1f}",
        )  # fmt: skip
    console.print(table)
    console.print(f"hit tokens: {report['hit_tokens_definition']}")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
